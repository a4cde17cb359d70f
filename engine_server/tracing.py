"""A request's identity across processes: logged here, passed on to the engine.

The engine request id is Dynamo's request id (the bridge uses its context id
unless a rollout names its own), so grepping one id finds a request in the
frontend's, the bridge's and this server's logs. A request may also carry W3C
trace context (``traceparent``, ``tracestate``; a unary ``Rollout`` or
``Generate`` call in its metadata, with ``x-request-id``; a start on the
multiplexed streams in its ``trace_context``): it is kept for the request's
task in a context variable, logged with the id, and handed to vLLM as the
request's trace headers (its OpenTelemetry spans then join the trace).

One DEBUG line per request, built only when DEBUG is on for
``engine_server.requests`` (``--log-level debug``): nothing costs otherwise.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable, Mapping

import grpc

from engine_contract.text import clip
from engine_contract.trace import trace_context

log = logging.getLogger("engine_server.requests")

# What a call's metadata may carry, forwarded as is (lower case, as gRPC has it).
TRACE_KEYS = frozenset({"traceparent", "tracestate", "x-request-id"})

_headers: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "trace_headers", default=None
)


def bind(context: grpc.aio.ServicerContext) -> None:
    """Keep the call's trace headers for its task (a unary call: one request)."""
    metadata = context.invocation_metadata()
    if metadata:
        use((k, v) for k, v in metadata if isinstance(v, str))


def use_start(trace: Mapping[str, str]) -> None:
    """Keep a stream start's ``trace_context`` for its task, like a unary call's
    metadata (only the W3C keys, each within the contract's bound: an entry over
    it is dropped, and the request runs untraced rather than failing)."""
    headers = trace_context(trace)
    if headers:
        _headers.set(headers)
    elif log.isEnabledFor(logging.DEBUG):
        log.debug(
            "trace context dropped (over the bound, or no W3C keys): %s",
            sorted((clip(k, 40), len(v)) for k, v in list(trace.items())[:8]),
        )


def use(pairs: Iterable[tuple[str, str]]) -> None:
    """Keep these trace headers for the current task (one request); keys other
    than TRACE_KEYS are dropped."""
    headers = {k: v for k, v in pairs if k in TRACE_KEYS}
    if headers:
        _headers.set(headers)


def trace_headers() -> Mapping[str, str] | None:
    """The current request's trace headers (None: none came with it)."""
    return _headers.get()


def started(kind: str, request_id: str) -> None:
    """One line per request, with its id and trace context (DEBUG only)."""
    if log.isEnabledFor(logging.DEBUG):
        headers = _headers.get()
        log.debug(
            "%s %s started%s",
            kind,
            request_id,
            "".join(f" {k}={v}" for k, v in sorted(headers.items())) if headers else "",
        )
