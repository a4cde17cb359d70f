"""Rollouts: many rollouts over one stream, answered as Rollout calls would be."""

from __future__ import annotations

import asyncio

import grpc

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import idle, wait_load_async
from tests.conformance.common import long_generate, make_prompt, new_id


def greedy(
    info: pb.GetServerInfoResponse, seed: int, max_new_tokens: int = 24
) -> pb.RolloutRequest:
    return pb.RolloutRequest(
        request_id=new_id("rs"),
        prompt_token_ids=make_prompt(info, 6 + seed % 11, seed),
        greedy=True,
        max_new_tokens=max_new_tokens,
    )


def long_rollout(info: pb.GetServerInfoResponse, seed: int) -> pb.RolloutRequest:
    return pb.RolloutRequest(
        request_id=new_id("rsl"),
        prompt_token_ids=make_prompt(info, 8, seed),
        max_new_tokens=min(400, info.engine_config.context_length - 8),
    )


async def read_results(  # type: ignore[no-untyped-def]
    call, count: int, results: dict[int, pb.RolloutResult] | None = None
) -> dict[int, pb.RolloutResult]:
    """The call's next ``count`` results, by tag; ``results`` (when given) fills as
    they arrive, so that a wait can count the rollouts that already ended."""
    results = {} if results is None else results
    while len(results) < count:
        message = await asyncio.wait_for(call.read(), 30)
        assert message != grpc.aio.EOF, f"stream ended after {len(results)} of {count} results"
        for result in message.results:
            assert result.tag not in results, f"tag {result.tag} answered twice"
            results[result.tag] = result
    return results


async def start_long_rollouts(  # type: ignore[no-untyped-def]
    stub, call, info: pb.GetServerInfoResponse, tags: range, seed: int
) -> tuple[dict[int, pb.RolloutResult], asyncio.Future[dict[int, pb.RolloutResult]]]:
    """Long rollouts started on the stream, one per tag (seeds counting up from
    ``seed``), and read as they end: their results (filling) and the reader; returns
    once every one is registered, but those already answered (a sampled rollout may
    end early on EOS)."""
    starts = [
        pb.RolloutStart(tag=t, rollout=long_rollout(info, seed + i)) for i, t in enumerate(tags)
    ]
    await call.write(pb.RolloutsRequest(start=starts))
    results: dict[int, pb.RolloutResult] = {}
    reader = asyncio.ensure_future(read_results(call, len(tags), results))
    await wait_load_async(stub, lambda load: load.registered_requests + len(results) >= len(tags))
    return results, reader


def error_of(result: pb.RolloutResult) -> tuple[grpc.StatusCode, str]:
    assert result.WhichOneof("outcome") == "error", result
    code = next(c for c in grpc.StatusCode if c.value[0] == result.error.code)
    return code, result.error.message


async def test_stream_answers_equal_rollout_calls(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    requests = {tag: greedy(server_info, seed=tag) for tag in range(1, 13)}
    call = stub.Rollouts()
    # Six in the first message, then one message each.
    await call.write(
        pb.RolloutsRequest(start=[pb.RolloutStart(tag=t, rollout=requests[t]) for t in range(1, 7)])
    )
    for tag in range(7, 13):
        await call.write(
            pb.RolloutsRequest(start=[pb.RolloutStart(tag=tag, rollout=requests[tag])])
        )
    results = await read_results(call, len(requests))
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    for tag, request in requests.items():
        streamed = results[tag].response
        assert results[tag].WhichOneof("outcome") == "response"
        assert streamed.request_id == request.request_id
        assert streamed.instance_id == server_info.instance_id
        request.request_id = new_id("rs-unary")
        unary = await stub.Rollout(request)
        assert list(streamed.token_ids) == list(unary.token_ids)
        assert list(streamed.logprobs) == list(unary.logprobs)
        assert streamed.finish_reason == unary.finish_reason
        assert streamed.truncated == unary.truncated
        assert streamed.usage.completion_tokens == unary.usage.completion_tokens


async def test_a_failed_rollout_fails_alone(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    # A Generate call holds a request id (EOS ignored, so it surely still runs).
    held = long_generate(server_info, new_id("rs-held"))
    generate = stub.Generate(held)
    assert (await asyncio.wait_for(generate.read(), 10)).token_ids
    empty = pb.RolloutRequest(request_id=new_id("rs-bad"), max_new_tokens=4)
    duplicate_id = pb.RolloutRequest(
        request_id=held.request_id, prompt_token_ids=[5, 6, 7], max_new_tokens=4
    )
    call = stub.Rollouts()
    # Tag 1 twice in one message: the second finds the first running.
    await call.write(
        pb.RolloutsRequest(
            start=[
                pb.RolloutStart(tag=1, rollout=greedy(server_info, seed=4)),
                pb.RolloutStart(tag=1, rollout=greedy(server_info, seed=5)),
                pb.RolloutStart(tag=2, rollout=empty),
                pb.RolloutStart(tag=3, rollout=duplicate_id),
                pb.RolloutStart(tag=4, rollout=greedy(server_info, seed=6, max_new_tokens=4)),
            ]
        )
    )
    results: dict[int, list[pb.RolloutResult]] = {}
    while sum(len(r) for r in results.values()) < 5:
        message = await asyncio.wait_for(call.read(), 30)
        for result in message.results:
            results.setdefault(result.tag, []).append(result)
    code, message = error_of(results[2][0])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in message
    code, message = error_of(results[3][0])
    assert code == grpc.StatusCode.ALREADY_EXISTS and held.request_id in message
    tag_errors = [r for r in results[1] if r.WhichOneof("outcome") == "error"]
    assert len(tag_errors) == 1 and len(results[1]) == 2
    code, message = error_of(tag_errors[0])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tag" in message
    assert results[4][0].response.usage.completion_tokens >= 1
    # The stream goes on after the failures.
    await call.write(
        pb.RolloutsRequest(start=[pb.RolloutStart(tag=5, rollout=greedy(server_info, seed=7))])
    )
    assert (await read_results(call, 1))[5].WhichOneof("outcome") == "response"
    call.cancel()
    generate.cancel()


async def test_cancel_aborts_the_engine_request(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    call = stub.Rollouts()
    results, reader = await start_long_rollouts(stub, call, server_info, range(10, 13), seed=20)
    await call.write(pb.RolloutsRequest(cancel=[10, 11, 12, 999]))
    await asyncio.wait_for(reader, 60)
    for tag in (10, 11, 12):
        if results[tag].WhichOneof("outcome") == "error":
            assert error_of(results[tag])[0] == grpc.StatusCode.CANCELLED
    await wait_load_async(stub, idle, 1.0, "engine idle 1 s after cancel")
    # Still usable after cancels.
    await call.write(
        pb.RolloutsRequest(start=[pb.RolloutStart(tag=10, rollout=greedy(server_info, 1))])
    )
    assert (await read_results(call, 1))[10].WhichOneof("outcome") == "response"
    call.cancel()


async def test_ending_the_stream_aborts_its_rollouts(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    call = stub.Rollouts()
    _, reader = await start_long_rollouts(stub, call, server_info, range(6), seed=40)
    call.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await wait_load_async(stub, idle, 1.0, "engine idle 1 s after the stream ended")


async def test_half_close_lets_running_rollouts_finish(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    call = stub.Rollouts()
    requests = [greedy(server_info, seed=60 + i, max_new_tokens=16) for i in range(3)]
    await call.write(
        pb.RolloutsRequest(
            start=[pb.RolloutStart(tag=i, rollout=r) for i, r in enumerate(requests)]
        )
    )
    await call.done_writing()
    results = await read_results(call, 3)
    assert all(r.WhichOneof("outcome") == "response" for r in results.values())
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
