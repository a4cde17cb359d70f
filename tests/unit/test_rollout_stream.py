"""RolloutStream's own rules, without gRPC: one result per tag, batching, size
limits, cancels, and what ends the stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_server.errors import Draining, InvalidRequest, StreamStalled
from engine_server.rollout_stream import RolloutStream
from harness.engine import ClientMessages, StreamContext
from harness.waits import wait_until_async


class Context(StreamContext[pb.RolloutsResponse]):
    def results(self) -> dict[int, pb.RolloutResult]:
        return {r.tag: r for m in self.written for r in m.results}


class Requests(ClientMessages[pb.RolloutsRequest]):
    """The client side of the stream: put messages, then close (half-close)."""

    def start(self, *tags: int, size: int = 3) -> None:
        self.queue.put_nowait(
            pb.RolloutsRequest(
                start=[
                    pb.RolloutStart(
                        tag=t, rollout=pb.RolloutRequest(request_id=f"r{t}", max_new_tokens=size)
                    )
                    for t in tags
                ]
            )
        )


async def answer(request: pb.RolloutRequest, into: pb.RolloutResponse) -> None:
    """Answers with max_new_tokens tokens after as many loop turns; 0 is refused;
    999 never finishes."""
    if request.max_new_tokens == 0:
        raise InvalidRequest("max_new_tokens", "must be > 0 here")
    if request.max_new_tokens == 999:
        await asyncio.Event().wait()
    for _ in range(request.max_new_tokens):
        await asyncio.sleep(0)
    into.request_id = request.request_id
    into.token_ids.extend(range(request.max_new_tokens))


def stream(ctx: Context, limit: int = 1 << 20, timeout: float | None = None) -> RolloutStream:
    return RolloutStream(answer, ctx, max_message_bytes=limit, write_timeout_s=timeout)  # type: ignore[arg-type]


async def test_every_tag_answered_once_and_answers_ready_together_share_a_write() -> None:
    ctx, requests = Context(), Requests()
    requests.start(*range(1, 21))
    requests.start(21, size=0)
    requests.queue.put_nowait(None)
    await asyncio.wait_for(stream(ctx).serve(requests), 5)
    results = ctx.results()
    assert sorted(results) == list(range(1, 22))
    assert sum(len(m.results) for m in ctx.written) == 21
    assert len(ctx.written) < 10  # 20 answers finishing on the same loop turn
    assert list(results[7].response.token_ids) == [0, 1, 2]
    assert results[21].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_new_tokens" in results[21].error.message


async def test_an_answer_over_the_limit_is_refused_alone_and_batches_stay_under_it() -> None:
    ctx, requests = Context(), Requests()
    requests.start(1, size=5000)  # ~10 KB of token ids, over a 4 KiB limit
    requests.start(*range(2, 40), size=100)
    requests.queue.put_nowait(None)
    await asyncio.wait_for(stream(ctx, limit=4096).serve(requests), 5)
    results = ctx.results()
    assert results[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "4096 bytes" in results[1].error.message
    assert all(results[t].WhichOneof("outcome") == "response" for t in range(2, 40))
    assert all(m.ByteSize() <= 4096 for m in ctx.written)
    assert len(ctx.written) > 1


async def test_cancel_answers_cancelled_and_a_duplicate_tag_is_refused() -> None:
    ctx, requests = Context(), Requests()
    rollouts = stream(ctx)
    serving = asyncio.ensure_future(rollouts.serve(requests))
    requests.start(5, size=999)
    requests.start(5, size=1)
    await wait_until_async(lambda: ctx.written, 5, "the duplicate tag refused")
    requests.queue.put_nowait(pb.RolloutsRequest(cancel=[5, 77]))
    requests.queue.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    codes = [r.error.code for m in ctx.written for r in m.results]
    assert sorted(codes) == sorted(
        [grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.CANCELLED.value[0]]
    )


async def test_a_stalled_write_ends_the_stream_and_cancels_what_runs() -> None:
    ctx, requests = Context(), Requests()
    ctx.gate.clear()  # a client that stopped reading
    rollouts = stream(ctx, timeout=0.05)
    requests.start(1, size=1)
    requests.start(2, size=999)
    with pytest.raises(StreamStalled, match="every rollout still running on it"):
        await asyncio.wait_for(rollouts.serve(requests), 5)
    assert not rollouts._running


async def test_close_answers_what_runs_then_ends_unavailable() -> None:
    ctx, requests = Context(), Requests()
    rollouts = stream(ctx)
    serving = asyncio.ensure_future(rollouts.serve(requests))
    requests.start(1, size=50)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    rollouts.close()
    with pytest.raises(Draining):
        await asyncio.wait_for(serving, 5)
    assert ctx.results()[1].WhichOneof("outcome") == "response"
