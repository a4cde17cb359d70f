"""A request's identity across processes: logged here, passed on to the engine.

The engine request id is Dynamo's request id (the bridge uses its context id
unless a rollout names its own), so grepping one id finds a request in the
frontend's, the bridge's and this server's logs. A unary ``Rollout`` or
``Generate`` call may also carry W3C trace context in its metadata
(``traceparent``, ``tracestate``, ``x-request-id``): it is kept for the call's
task in a context variable, logged with the id, and handed to vLLM as the
request's trace headers (its OpenTelemetry spans then join the trace). Requests
on the multiplexed streams carry their id in the request message only.

One DEBUG line per request, built only when DEBUG is on for
``engine_server.requests`` (``--log-level debug``): nothing costs otherwise.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping

import grpc

log = logging.getLogger("engine_server.requests")

# What a call's metadata may carry, forwarded as is (lower case, as gRPC has it).
TRACE_KEYS = frozenset({"traceparent", "tracestate", "x-request-id"})

_headers: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "trace_headers", default=None
)


def bind(context: grpc.aio.ServicerContext) -> None:
    """Keep the call's trace headers for its task (a unary call: one request)."""
    metadata = context.invocation_metadata()
    if not metadata:
        return
    headers = {k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)}
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
