"""The bridge passes Dynamo's W3C trace context on to the engine server on every
transport: in a stream start's ``trace_context`` (contract revision 5) or in a
unary call's metadata (with ``x-request-id``, Dynamo's request id), bounded as
``engine_contract.trace`` says; nothing when Dynamo has none."""

from __future__ import annotations

from typing import Any

import pytest
from dynamo._core import Context

from engine_contract.trace import MAX_TRACE_VALUE_CHARS
from tests.bridge.bridge_fakes import FakeServer, bridge_on

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class TracedContext:
    """Dynamo's Context with trace headers (Dynamo has them only with its OTel
    layer on; a Context built in Python has none)."""

    def __init__(self, context_id: str, headers: dict[str, str] | None) -> None:
        self._context = Context(id=context_id)
        self._headers = headers

    def trace_headers(self) -> dict[str, str] | None:
        return self._headers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


CASES = [
    ("rollout", "stream"),
    ("rollout", "unary"),
    ("completion", "stream"),
    ("completion", "unary"),
]


@pytest.mark.parametrize(("kind", "transport"), CASES)
async def test_trace_context_reaches_the_engine_server(kind: str, transport: str) -> None:
    async with FakeServer() as server:
        async with bridge_on(
            server, rollout_transport=transport, generate_transport=transport
        ) as engine:
            request: dict[str, Any] = {"token_ids": [4, 5], "stop_conditions": {"max_tokens": 2}}
            if kind == "rollout":
                request["annotations"] = ['rollout:{"greedy":true}']
            headers = {
                "traceparent": TRACEPARENT,
                "tracestate": "x" * (MAX_TRACE_VALUE_CHARS + 1),  # over the bound: not sent
                "baggage": "k=v",  # not trace context the contract carries
            }
            for context_id, given in (("traced", headers), ("untraced", None)):
                context: Any = TracedContext(context_id, given)
                chunks = [c async for c in engine.generate(dict(request), context=context)]
                assert chunks, context_id
        streamed = transport == "stream"
        fake = server.engine
        assert (fake.streamed_rollouts if kind == "rollout" else fake.generate_streams) == (
            (2 if kind == "rollout" else 1) if streamed else 0
        )
        unary_id = {"x-request-id": "traced"} if not streamed else {}
        assert fake.traces["traced"] == {"traceparent": TRACEPARENT, **unary_id}
        assert fake.traces["untraced"] == ({"x-request-id": "untraced"} if not streamed else None)
