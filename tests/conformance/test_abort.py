"""Abort, cancellation, duplicate ids, and clients that die."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import idle, wait_load_async
from tests.conformance.common import long_generate, make_prompt, new_id


async def start_stream(stub, request: pb.GenerateRequest):  # type: ignore[no-untyped-def]
    """Start a Generate call and wait for its first delta (the engine is running it)."""
    call = stub.Generate(request)
    first = await asyncio.wait_for(call.read(), 10)
    assert first.token_ids
    return call


async def drain(call) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    out = []
    while (message := await asyncio.wait_for(call.read(), 10)) != grpc.aio.EOF:
        out.append(message)
    return out


async def test_abort_ends_stream_with_aborted_and_is_idempotent(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request_id = new_id("ab")
    call = await start_stream(stub, long_generate(server_info, request_id))
    answer = await stub.Abort(pb.AbortRequest(request_id=request_id))
    assert answer.outcome == pb.ABORT_OUTCOME_ABORTED and answer.aborted_count == 1
    rest = await drain(call)
    assert rest[-1].finished.finish_reason == pb.FINISH_REASON_ABORTED
    await wait_load_async(stub, idle, 1.0, "engine idle after abort")
    again = await stub.Abort(pb.AbortRequest(request_id=request_id))
    assert again.outcome == pb.ABORT_OUTCOME_ALREADY_FINISHED and again.aborted_count == 0
    unknown = await stub.Abort(pb.AbortRequest(request_id=new_id("never")))
    assert unknown.outcome == pb.ABORT_OUTCOME_NOT_FOUND


async def test_abort_for_another_instance_touches_nothing(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request_id = new_id("ab")
    call = await start_stream(stub, long_generate(server_info, request_id, max_tokens=60))
    answer = await stub.Abort(pb.AbortRequest(request_id=request_id, instance_id="stale"))
    assert answer.outcome == pb.ABORT_OUTCOME_NOT_FOUND
    rest = await drain(call)
    assert rest[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH


async def test_abort_rollout_returns_partial_prefix(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    # A prompt whose greedy rollout, left alone, runs long enough to abort mid-way.
    budget = min(300, server_info.engine_config.context_length - 8)
    for seed in range(11, 41):
        prompt = make_prompt(server_info, 8, seed)
        full = await stub.Rollout(
            pb.RolloutRequest(
                request_id=new_id("ro"), prompt_token_ids=prompt, greedy=True, max_new_tokens=budget
            )
        )
        if len(full.token_ids) >= 100:
            break
    else:
        pytest.fail("every greedy rollout stopped within 100 tokens")
    request_id = new_id("ro")
    pending = asyncio.ensure_future(
        stub.Rollout(
            pb.RolloutRequest(
                request_id=request_id, prompt_token_ids=prompt, greedy=True, max_new_tokens=budget
            )
        )
    )
    await wait_load_async(stub, lambda load: load.running_requests >= 1)
    await asyncio.sleep(0.05)
    answer = await stub.Abort(pb.AbortRequest(request_id=request_id))
    result = await pending
    assert answer.outcome == pb.ABORT_OUTCOME_ABORTED
    assert result.finish_reason == pb.FINISH_REASON_ABORTED and not result.truncated
    assert list(result.token_ids) == list(full.token_ids)[: len(result.token_ids)]
    assert list(result.logprobs) == list(full.logprobs)[: len(result.logprobs)]
    assert len(result.token_ids) < len(full.token_ids)


async def test_abort_all_ends_every_running_request_aborted(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    calls = [
        await start_stream(stub, long_generate(server_info, new_id("all"), seed=i, max_tokens=2000))
        for i in range(4)
    ]
    answer = await stub.Abort(pb.AbortRequest(all=True))
    assert answer.outcome == pb.ABORT_OUTCOME_ABORTED and answer.aborted_count >= 4
    for call in calls:
        assert (await drain(call))[-1].finished.finish_reason == pb.FINISH_REASON_ABORTED
    await wait_load_async(stub, idle, 1.0, "engine idle")


async def test_cancelled_calls_abort_their_engine_requests(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    calls = [
        await start_stream(stub, long_generate(server_info, new_id("cx"), seed=i, max_tokens=2000))
        for i in range(8)
    ]
    rollouts = [
        asyncio.ensure_future(
            stub.Rollout(
                pb.RolloutRequest(
                    request_id=new_id("cxr"),
                    prompt_token_ids=make_prompt(server_info, 8, 50 + i),
                    max_new_tokens=min(2000, server_info.engine_config.context_length - 8),
                )
            )
        )
        for i in range(8)
    ]
    # Read, so that a stream that ended is seen to have ended.
    readers = [asyncio.ensure_future(drain(call)) for call in calls]
    # Every call running, but those that already ended: a rollout may end early on
    # EOS, and a fast engine (vLLM, the tiny model) may finish a stream meanwhile.
    await wait_load_async(
        stub,
        lambda load: (
            load.registered_requests + sum(t.done() for t in (*readers, *rollouts))
            >= len(calls) + len(rollouts)
        ),
    )
    for call in calls:
        call.cancel()
    for pending in rollouts:
        pending.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    await wait_load_async(stub, idle, 1.0, "engine idle 1 s after cancel")


async def test_duplicate_active_request_id_is_refused_then_reusable(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request_id = new_id("dup")
    call = await start_stream(stub, long_generate(server_info, request_id, max_tokens=300))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rollout(
            pb.RolloutRequest(
                request_id=request_id, prompt_token_ids=make_prompt(server_info, 4, 1)
            )
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert request_id in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain(stub.Generate(long_generate(server_info, request_id)))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    rest = await drain(call)
    assert rest[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH, "the first one is intact"
    reused = await stub.Rollout(
        pb.RolloutRequest(
            request_id=request_id, prompt_token_ids=make_prompt(server_info, 4, 1), max_new_tokens=2
        )
    )
    assert reused.request_id == request_id


CLIENT = textwrap.dedent("""
    import sys, grpc
    from engine_contract.v1 import engine_pb2 as pb, engine_pb2_grpc as pb_grpc
    address, n = sys.argv[1], int(sys.argv[2])
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EngineServiceStub(channel)
    streams = []
    for i in range(n):
        request = pb.GenerateRequest(request_id=f"dying-{i}", prompt_token_ids=[5, 6, 7, 8 + i])
        request.stop.max_tokens = int(sys.argv[3])
        request.stop.ignore_eos = True
        stream = stub.Generate(request)
        next(stream)
        streams.append(stream)
    print("running", flush=True)
    sys.stdin.read()
""")


async def test_client_process_killed_aborts_its_requests(stub, server_info, engine_address) -> None:  # type: ignore[no-untyped-def]
    max_tokens = min(2000, server_info.engine_config.context_length - 8)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, engine_address, "4", str(max_tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert client.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), 30)
        assert line.strip() == b"running"
        load = await stub.GetLoad(pb.GetLoadRequest())
        assert load.registered_requests >= 4
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        await wait_load_async(stub, idle, 2.0, "requests of a dead client ended")
    finally:
        client.kill()
