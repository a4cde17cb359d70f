"""GenerateStream: completions' deltas packed per message and merged per completion
while a write is in flight, failures alone, cancel by tag."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server.errors import InvalidRequest
from engine_server.generate_stream import GenerateStream
from harness.engine import ClientMessages, StreamContext
from harness.waits import wait_until_async


class Context(StreamContext[pb.GeneratesResponse]):
    def deltas(self, tag: int) -> list[pb.GenerateDelta]:
        return [d for m in self.written for d in m.deltas if d.tag == tag]


class Requests(ClientMessages[pb.GeneratesRequest]):
    def start(self, *tags: int, tokens: int = 4) -> None:
        self.queue.put_nowait(
            pb.GeneratesRequest(
                start=[
                    pb.GenerateStart(
                        tag=t,
                        generate=pb.GenerateRequest(
                            request_id=f"g{t}", stop=pb.StopConditions(max_tokens=tokens)
                        ),
                    )
                    for t in tags
                ]
            )
        )


async def deltas(request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
    """One token per loop turn, then ``finished``; 0 tokens is refused, 999 never ends,
    7 fails after 3 tokens."""
    n = request.stop.max_tokens
    if n == 0:
        raise InvalidRequest("max_tokens", "must be > 0 here")
    for i in range(n if n != 999 else 10**9):
        await asyncio.sleep(0)
        if n == 7 and i == 3:
            raise InvalidRequest("engine", "failed half way")
        yield pb.GenerateResponse(token_ids=[i], logprobs=[-float(i)])
    yield pb.GenerateResponse(
        finished=pb.GenerateFinished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=n)
        )
    )


def stream(ctx: Context, limit: int = 1 << 20) -> GenerateStream:
    return GenerateStream(deltas, ctx, max_message_bytes=limit, write_timeout_s=None)  # type: ignore[arg-type]


def tokens(ds: list[pb.GenerateDelta]) -> list[int]:
    return [t for d in ds for t in d.response.token_ids]


async def test_an_idle_stream_writes_each_delta_at_once() -> None:
    """Tokens 5 ms apart (a real engine's steps): each goes out alone, at once."""

    async def paced(request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
        for i in range(5):
            await asyncio.sleep(0.005)
            yield pb.GenerateResponse(token_ids=[i])
        yield pb.GenerateResponse(finished=pb.GenerateFinished(usage=pb.Usage(completion_tokens=5)))

    ctx, requests = Context(), Requests()
    requests.start(1, tokens=5)
    requests.queue.put_nowait(None)
    s = GenerateStream(paced, ctx, max_message_bytes=1 << 20, write_timeout_s=None)  # type: ignore[arg-type]
    await asyncio.wait_for(s.serve(requests), 5)
    ds = ctx.deltas(1)
    assert tokens(ds) == [0, 1, 2, 3, 4]
    assert len(ds) >= 5  # nothing held back
    assert ds[-1].response.finished.usage.completion_tokens == 5
    assert not any(d.response.HasField("finished") for d in ds[:-1])


async def _paced(request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
    """Ten tokens 1 ms apart, then ``finished``."""
    for i in range(10):
        await asyncio.sleep(0.001)
        yield pb.GenerateResponse(token_ids=[i])
    yield pb.GenerateResponse(finished=pb.GenerateFinished(usage=pb.Usage(completion_tokens=10)))


async def _held(completions: int, hold_from: int) -> list[list[pb.GenerateDelta]]:
    ctx, requests = Context(), Requests()
    tags = list(range(1, completions + 1))
    requests.start(*tags, tokens=10)
    requests.queue.put_nowait(None)
    s = GenerateStream(
        _paced,  # type: ignore[arg-type]
        ctx,  # type: ignore[arg-type]
        max_message_bytes=1 << 20,
        write_timeout_s=None,
        hold_s=0.02,
        hold_from=hold_from,
    )
    await asyncio.wait_for(s.serve(requests), 5)
    return [ctx.deltas(tag) for tag in tags]


async def test_a_busy_stream_holds_writes_so_tokens_merge() -> None:
    """hold_from completions running: the writer waits hold_s after each write, so
    the tokens made meanwhile go out merged (all of them, in order, and finished last)."""
    for ds in await _held(completions=4, hold_from=4):
        assert tokens(ds) == list(range(10))
        assert len(ds) <= 3  # the first token alone, then ~20 ms of tokens per delta
        assert ds[-1].response.finished.usage.completion_tokens == 10


async def test_a_stream_below_the_hold_threshold_writes_at_once() -> None:
    for ds in await _held(completions=3, hold_from=4):
        assert tokens(ds) == list(range(10))
        assert len(ds) >= 8  # tokens 1 ms apart, each written as it came


async def test_deltas_queued_behind_a_slow_write_are_merged_per_completion() -> None:
    ctx, requests = Context(), Requests()
    ctx.gate.clear()
    requests.start(1, 2, 3, tokens=50)
    requests.queue.put_nowait(None)
    finished: list[str] = []

    async def counted(request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
        async for response in deltas(request):
            if response.HasField("finished"):
                finished.append(request.request_id)
            yield response

    s = GenerateStream(counted, ctx, max_message_bytes=1 << 20, write_timeout_s=None)  # type: ignore[arg-type]
    serving = asyncio.ensure_future(s.serve(requests))
    # Every completion finishes while the first write waits.
    await wait_until_async(lambda: len(finished) == 3, 5, "the three completions finished")
    ctx.gate.set()
    await asyncio.wait_for(serving, 5)
    for tag in (1, 2, 3):
        ds = ctx.deltas(tag)
        assert tokens(ds) == list(range(50))
        assert [lp for d in ds for lp in d.response.logprobs] == [-float(i) for i in range(50)]
        assert len(ds) <= 2  # the first one written, then everything else merged
        assert ds[-1].response.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(ctx.written) <= 2


async def test_failures_end_their_completion_alone() -> None:
    ctx, requests = Context(), Requests()
    requests.start(1, tokens=0)
    requests.start(2, tokens=7)
    requests.start(3, tokens=3)
    requests.start(3, tokens=3)  # tag 3 still running: refused alone
    requests.queue.put_nowait(None)
    await asyncio.wait_for(stream(ctx).serve(requests), 5)
    assert ctx.deltas(1)[-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    failed = ctx.deltas(2)
    assert tokens(failed[:-1]) == [0, 1, 2] and "half way" in failed[-1].error.message
    three = ctx.deltas(3)
    assert tokens(three) == [0, 1, 2]
    assert [d.error.code for d in three if d.WhichOneof("outcome") == "error"] == [
        grpc.StatusCode.INVALID_ARGUMENT.value[0]
    ]
    assert three[-1].response.finished.usage.completion_tokens == 3


async def test_cancel_by_tag_ends_the_completion_cancelled() -> None:
    ctx, requests = Context(), Requests()
    requests.start(5, tokens=999)
    serving = asyncio.ensure_future(stream(ctx).serve(requests))
    await wait_until_async(lambda: ctx.deltas(5), 5, "the completion's first delta")
    requests.queue.put_nowait(pb.GeneratesRequest(cancel=[5]))
    requests.queue.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    last = ctx.deltas(5)[-1]
    assert last.error.code == grpc.StatusCode.CANCELLED.value[0]


async def test_a_delta_over_the_message_limit_fails_its_completion() -> None:
    async def huge(request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
        yield pb.GenerateResponse(token_ids=[1])
        yield pb.GenerateResponse(token_ids=list(range(5000)))

    ctx, requests = Context(), Requests()
    requests.start(1)
    requests.queue.put_nowait(None)
    s = GenerateStream(huge, ctx, max_message_bytes=4096, write_timeout_s=None)  # type: ignore[arg-type]
    await asyncio.wait_for(s.serve(requests), 5)
    ds = ctx.deltas(1)
    assert ds[-1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert all(m.ByteSize() <= 4096 for m in ctx.written)


class RunAhead:
    """An engine that generates whether or not its output is read: one token every
    ``every_s``, what was not read yet merged into the next read (as vLLM's delta
    output collector does), and how many reads it answered."""

    def __init__(self, n: int, every_s: float = 0.001) -> None:
        self.n, self.every_s = n, every_s
        self.reads = 0

    async def __call__(
        self, request: pb.GenerateRequest
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        sent = 0
        while sent < self.n:
            made = min(self.n, int((loop.time() - began) / self.every_s) + 1)
            if made <= sent:
                await asyncio.sleep(self.every_s)
                continue
            self.reads += 1
            out = pb.GenerateResponse(
                token_ids=range(sent, made), logprobs=[-i for i in range(sent, made)]
            )
            sent = made
            if sent == self.n:
                out.finished.usage.completion_tokens = self.n
            yield out
            await asyncio.sleep(0)


def paced_start(tag: int, paced: bool = True) -> pb.GeneratesRequest:
    return pb.GeneratesRequest(
        start=[
            pb.GenerateStart(
                tag=tag, paced=paced, generate=pb.GenerateRequest(request_id=f"p{tag}")
            )
        ]
    )


async def test_a_paced_completion_gets_its_next_delta_once_the_last_is_taken() -> None:
    """No delta follows one the client has not taken; what the engine made meanwhile
    comes merged into the next, every token in order and ``finished`` last."""
    engine = RunAhead(n=40)
    ctx, requests = Context(), Requests()
    requests.queue.put_nowait(paced_start(1))
    serving = asyncio.ensure_future(stream_of(engine, ctx).serve(requests))
    taken = 0
    for _ in range(200):
        await asyncio.sleep(0.02)  # a slow client: 20 ms per delta, the engine 1 ms per token
        ds = ctx.deltas(1)
        assert len(ds) == taken + 1 or ds[-1].response.HasField("finished"), (
            f"{len(ds)} deltas written, {taken} taken"
        )
        if ds[-1].response.HasField("finished"):
            break
        taken += 1
        requests.queue.put_nowait(pb.GeneratesRequest(taken=[1, 99]))  # 99: no such tag
    requests.queue.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    ds = ctx.deltas(1)
    assert tokens(ds) == list(range(40))
    assert [lp for d in ds for lp in d.response.logprobs] == [-float(i) for i in range(40)]
    assert ds[-1].response.finished.usage.completion_tokens == 40
    assert not any(d.response.HasField("finished") for d in ds[:-1])
    assert len(ds) <= 4  # ~20 tokens per 20 ms the client took
    assert engine.reads <= 2 * len(ds)  # read only when a delta could go (unpaced: ~40 reads)


async def test_an_unpaced_completion_on_the_same_stream_is_not_held() -> None:
    engine = RunAhead(n=20, every_s=0.002)
    ctx, requests = Context(), Requests()
    requests.queue.put_nowait(paced_start(1))
    requests.queue.put_nowait(paced_start(2, paced=False))
    serving = asyncio.ensure_future(stream_of(engine, ctx).serve(requests))
    await asyncio.sleep(0.2)  # tag 1's first delta is never taken
    unpaced = ctx.deltas(2)
    assert tokens(unpaced) == list(range(20)) and len(unpaced) >= 5
    held = ctx.deltas(1)
    assert len(held) == 1 and not held[0].response.HasField("finished")
    requests.queue.put_nowait(pb.GeneratesRequest(taken=[1]))
    await wait_until_async(
        lambda: ctx.deltas(1)[-1].response.HasField("finished"), 5, "tag 1 finished once taken"
    )
    held = ctx.deltas(1)
    assert tokens(held) == list(range(20)) and len(held) == 2  # the rest in one delta
    requests.queue.put_nowait(None)
    await asyncio.wait_for(serving, 5)


async def test_a_held_paced_completion_is_cancelled_by_tag() -> None:
    engine = RunAhead(n=10**6)
    ctx, requests = Context(), Requests()
    requests.queue.put_nowait(paced_start(3))
    serving = asyncio.ensure_future(stream_of(engine, ctx).serve(requests))
    await wait_until_async(lambda: ctx.deltas(3), 5, "the held completion's first delta")
    requests.queue.put_nowait(pb.GeneratesRequest(cancel=[3]))
    requests.queue.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    ds = ctx.deltas(3)
    assert len(ds) == 2 and ds[-1].error.code == grpc.StatusCode.CANCELLED.value[0]


def stream_of(engine: RunAhead, ctx: Context) -> GenerateStream:
    return GenerateStream(engine, ctx, max_message_bytes=1 << 20, write_timeout_s=None)  # type: ignore[arg-type]
