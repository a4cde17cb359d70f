"""A request's W3C trace context reaches the engine on every path (contract
revision 5): a unary call's metadata, a ``Rollouts`` or ``Generates`` start's
``trace_context``. The backend sees it as the request's trace headers (vLLM's
``trace_headers``), for that request alone: two requests on one stream, each
with its own trace, and one without any. Over the bound it is dropped, and the
request runs.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any

import grpc
import pytest

from engine_contract.trace import MAX_TRACE_VALUE_CHARS
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server import tracing
from engine_server.backends.base import EngineOutput, SamplingSpec
from harness.engine import InProcessServer, sim_cli_args

TRACE_A = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_B = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# A stub for the server, and the trace headers its engine saw by request id.
Traced = tuple[pb_grpc.EngineServiceStub, dict[str, Mapping[str, str] | None]]


@pytest.fixture
def server() -> Iterator[Traced]:
    """A stub for a sim server whose backend records each request's trace headers by
    id, and that record."""
    server = InProcessServer.from_cli(*sim_cli_args())
    seen: dict[str, Mapping[str, str] | None] = {}
    backend: Any = server._backend
    generate = backend.generate

    def recording(
        request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        seen[request_id] = tracing.trace_headers()
        return generate(request_id, prompt_token_ids, spec)

    backend.generate = recording
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield pb_grpc.EngineServiceStub(channel), seen
    finally:
        server.stop()


def rollout(request_id: str) -> pb.RolloutRequest:
    return pb.RolloutRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], max_new_tokens=2)


def stream_rollouts(
    stub: pb_grpc.EngineServiceStub, traces: dict[str, dict[str, str] | None]
) -> None:
    """One Rollouts message starting a rollout per request id (tags from 1), each
    with its trace context (None: none); every one answered with a response."""
    message = pb.RolloutsRequest(
        start=[
            pb.RolloutStart(tag=tag, rollout=rollout(request_id), trace_context=trace)
            for tag, (request_id, trace) in enumerate(traces.items(), 1)
        ]
    )
    results = [r for m in stub.Rollouts(iter([message]), timeout=30) for r in m.results]
    tags = list(range(1, len(traces) + 1))
    assert sorted(r.tag for r in results if r.HasField("response")) == tags, results


def completion(request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7])
    request.stop.max_tokens = 2
    return request


def test_a_unary_call_passes_only_the_trace_headers_to_the_engine(server: Traced) -> None:
    stub, seen = server
    stub.Rollout(
        rollout("unary"),
        timeout=30,
        metadata=(("traceparent", TRACE_A), ("x-request-id", "dyn-1"), ("other", "x")),
    )
    stub.Rollout(rollout("unary-none"), timeout=30)
    assert seen["unary"] == {"traceparent": TRACE_A, "x-request-id": "dyn-1"}
    assert seen["unary-none"] is None


def test_rollouts_stream_starts_carry_their_own(server: Traced) -> None:
    stub, seen = server
    stream_rollouts(
        stub,
        {
            "a": {"traceparent": TRACE_A, "tracestate": "k=v", "bogus": "no"},
            "b": {"traceparent": TRACE_B},
            "none": None,
        },
    )
    assert seen["a"] == {"traceparent": TRACE_A, "tracestate": "k=v"}
    assert seen["b"] == {"traceparent": TRACE_B}
    assert seen["none"] is None


def test_generates_stream_starts_carry_their_own(server: Traced) -> None:
    stub, seen = server
    message = pb.GeneratesRequest(
        start=[
            pb.GenerateStart(
                tag=1, generate=completion("c"), trace_context={"traceparent": TRACE_A}
            ),
            pb.GenerateStart(tag=2, generate=completion("d")),
        ]
    )
    deltas = [d for m in stub.Generates(iter([message]), timeout=30) for d in m.deltas]
    finished = {d.tag for d in deltas if d.response.HasField("finished")}
    assert finished == {1, 2}, deltas
    assert seen["c"] == {"traceparent": TRACE_A}
    assert seen["d"] is None


def test_trace_context_over_the_bound_is_dropped_never_refused(server: Traced) -> None:
    """Trace context is advisory: a value over the bound, a long key or many other
    keys never fail the rollout; only the W3C entries within the bound are kept."""
    stub, seen = server
    long = "0" * (MAX_TRACE_VALUE_CHARS + 1)
    stream_rollouts(
        stub,
        {
            "long": {"traceparent": long},
            "partly": {"traceparent": TRACE_A, "tracestate": long, "k" * 100_000: "v"},
            "many": {f"key-{i}": "v" for i in range(1000)} | {"traceparent": TRACE_B},
        },
    )
    assert seen["long"] is None
    assert seen["partly"] == {"traceparent": TRACE_A}
    assert seen["many"] == {"traceparent": TRACE_B}
