"""Generates: many completions over one stream, each answered as its Generate call
would be (deltas possibly merged), failing alone, cancelled by tag."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import idle, wait_load_async
from tests.conformance.common import StreamResult, collect, long_generate, make_prompt, new_id


def greedy(info: pb.GetServerInfoResponse, seed: int, max_tokens: int = 20) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=new_id("gs"), prompt_token_ids=make_prompt(info, 6 + seed % 7, seed)
    )
    request.sampling.temperature = 0.0
    request.stop.max_tokens = max_tokens
    request.stop.ignore_eos = True
    request.output.logprobs = 2
    return request


def start(tag: int, request: pb.GenerateRequest) -> pb.GenerateStart:
    return pb.GenerateStart(tag=tag, generate=request)


async def read_streams(call, tags: set[int]) -> dict[int, StreamResult | pb.RolloutError]:  # type: ignore[no-untyped-def]
    """Every delta of ``tags`` up to each one's last: the completion, or its error
    (other tags' deltas are skipped)."""
    out: dict[int, StreamResult | pb.RolloutError] = {}
    open_ = {tag: StreamResult() for tag in tags}
    while open_:
        message = await asyncio.wait_for(call.read(), 30)
        assert message != grpc.aio.EOF, f"stream ended with {sorted(open_)} unfinished"
        for delta in message.deltas:
            assert delta.tag not in out, f"a delta for tag {delta.tag} after its last one"
            if delta.tag not in open_:
                continue
            if delta.WhichOneof("outcome") == "error":
                out[delta.tag] = delta.error
                del open_[delta.tag]
                continue
            result = open_[delta.tag]
            response = delta.response
            assert len(response.logprobs) in (0, len(response.token_ids))
            result.messages.append(response)
            result.token_ids.extend(response.token_ids)
            result.logprobs.extend(response.logprobs)
            result.top_logprobs.extend(response.top_logprobs)
            if response.HasField("finished"):
                out[delta.tag] = open_.pop(delta.tag)
    return out


def code_of(error: StreamResult | pb.RolloutError) -> grpc.StatusCode:
    assert isinstance(error, pb.RolloutError), "expected an error"
    return next(c for c in grpc.StatusCode if c.value[0] == error.code)


async def test_streamed_completions_equal_generate_calls(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    requests = {tag: greedy(server_info, seed=tag) for tag in range(1, 11)}
    call = stub.Generates()
    await call.write(pb.GeneratesRequest(start=[start(t, requests[t]) for t in range(1, 6)]))
    for tag in range(6, 11):
        await call.write(pb.GeneratesRequest(start=[start(tag, requests[tag])]))
    results = await read_streams(call, set(requests))
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    for tag, request in requests.items():
        streamed = results[tag]
        assert isinstance(streamed, StreamResult)
        # Only the last delta finishes.
        assert [m.HasField("finished") for m in streamed.messages][-1]
        assert not any(m.HasField("finished") for m in streamed.messages[:-1])
        request.request_id = new_id("gs-unary")
        unary = await collect(stub, request)
        assert streamed.token_ids == unary.token_ids
        assert streamed.logprobs == unary.logprobs
        assert streamed.top_logprobs == unary.top_logprobs
        got, want = streamed.finished, unary.finished
        assert got.finish_reason == want.finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens == 20
        assert got.instance_id == server_info.instance_id


async def test_a_failed_completion_fails_alone(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    held = long_generate(server_info, new_id("gs-held"))
    generate = stub.Generate(held)
    assert (await asyncio.wait_for(generate.read(), 10)).token_ids
    empty = pb.GenerateRequest(request_id=new_id("gs-bad"))
    duplicate_id = greedy(server_info, seed=3)
    duplicate_id.request_id = held.request_id
    call = stub.Generates()
    await call.write(
        pb.GeneratesRequest(
            start=[
                start(1, long_generate(server_info, new_id("gs-long"), seed=1)),
                start(2, empty),
                start(3, duplicate_id),
                start(4, greedy(server_info, seed=6, max_tokens=4)),
            ]
        )
    )
    results = await read_streams(call, {2, 3, 4})
    assert code_of(results[2]) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(results[3]) == grpc.StatusCode.ALREADY_EXISTS
    done = results[4]
    assert isinstance(done, StreamResult) and len(done.token_ids) == 4
    # The stream goes on after the failures.
    await call.write(pb.GeneratesRequest(start=[start(5, greedy(server_info, seed=7))]))
    assert isinstance((await read_streams(call, {5}))[5], StreamResult)
    call.cancel()
    generate.cancel()
    await wait_load_async(stub, idle, 2.0, "engine idle after the stream ended")


async def start_long_generates(  # type: ignore[no-untyped-def]
    stub, call, info: pb.GetServerInfoResponse, tags: range, prefix: str, seed: int
) -> None:
    """Long completions started on the stream, one per tag (ids from ``prefix``,
    seeds counting up from ``seed``); returns once the engine holds every one."""
    starts = [
        start(t, long_generate(info, new_id(prefix), seed=seed + i)) for i, t in enumerate(tags)
    ]
    await call.write(pb.GeneratesRequest(start=starts))
    await wait_load_async(stub, lambda load: load.registered_requests >= len(tags))


async def test_cancel_by_tag_aborts_the_engine_request(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    call = stub.Generates()
    await start_long_generates(stub, call, server_info, range(10, 13), "gsc", seed=0)
    await call.write(pb.GeneratesRequest(cancel=[10, 11, 12, 999]))
    results = await read_streams(call, {10, 11, 12})
    for tag in (10, 11, 12):
        assert code_of(results[tag]) == grpc.StatusCode.CANCELLED
    await wait_load_async(stub, idle, 1.0, "engine idle 1 s after cancel")
    await call.write(pb.GeneratesRequest(start=[start(10, greedy(server_info, seed=1))]))
    assert isinstance((await read_streams(call, {10}))[10], StreamResult)
    call.cancel()


async def test_ending_the_stream_aborts_its_completions(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    call = stub.Generates()
    await start_long_generates(stub, call, server_info, range(6), "gse", seed=40)
    call.cancel()
    await wait_load_async(stub, idle, 1.0, "engine idle 1 s after the stream ended")


async def test_a_paced_completion_waits_to_be_taken_and_loses_nothing(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    """Revision 6: after a paced completion's delta, the next comes only once the
    client names the tag in ``taken``; the deltas still add up to Generate's."""
    requests = {tag: greedy(server_info, seed=20 + tag) for tag in (1, 2, 3)}
    call = stub.Generates()
    await call.write(
        pb.GeneratesRequest(
            start=[pb.GenerateStart(tag=t, generate=r, paced=True) for t, r in requests.items()]
        )
    )
    results = {tag: StreamResult() for tag in requests}
    untaken: set[int] = set()
    finished: set[int] = set()

    def take(message: pb.GeneratesResponse) -> None:
        for delta in message.deltas:
            tag = delta.tag
            assert delta.WhichOneof("outcome") == "response", delta.error.message
            assert tag not in untaken, f"a second delta for tag {tag} before the first was taken"
            response = delta.response
            result = results[tag]
            result.messages.append(response)
            result.token_ids.extend(response.token_ids)
            result.logprobs.extend(response.logprobs)
            result.top_logprobs.extend(response.top_logprobs)
            (finished if response.HasField("finished") else untaken).add(tag)

    while untaken | finished != set(requests):  # every completion's first delta
        take(await asyncio.wait_for(call.read(), 30))
    # Not taken for a while: nothing more comes, though the engine runs on.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(reading := asyncio.ensure_future(call.read())), 0.5)
    assert untaken, "every completion finished in its first delta: nothing was paced"
    await call.write(pb.GeneratesRequest(taken=sorted(untaken)))
    untaken.clear()
    message = await asyncio.wait_for(reading, 30)
    while True:
        take(message)
        if finished == set(requests):
            break
        if untaken:
            await call.write(pb.GeneratesRequest(taken=sorted(untaken)))
            untaken.clear()
        message = await asyncio.wait_for(call.read(), 30)
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF
    for tag, request in requests.items():
        request.request_id = new_id("gs-paced-unary")
        unary = await collect(stub, request)
        paced = results[tag]
        assert paced.token_ids == unary.token_ids and len(paced.token_ids) == 20
        assert paced.logprobs == unary.logprobs
        assert paced.top_logprobs == unary.top_logprobs
        assert paced.finished.finish_reason == unary.finished.finish_reason
        assert paced.finished.usage.completion_tokens == 20
        assert not any(m.HasField("finished") for m in paced.messages[:-1])
