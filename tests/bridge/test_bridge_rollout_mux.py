"""RolloutMux: the bridge's rollouts over one Rollouts stream, against a fake
engine server that answers with the real server's stream handling."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from dynamo._core import Context

from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb
from harness.waits import wait_until_async
from tests.bridge.bridge_fakes import FakeEngine, FakeServer, bridge_on


def rollout(request_id: str, *prompt: int) -> pb.RolloutRequest:
    return pb.RolloutRequest(request_id=request_id, prompt_token_ids=list(prompt or (5, 6, 7)))


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeServer, EngineClient]]:
    async with FakeServer() as server:
        client = EngineClient(server.address)
        client.use_server_limits(await client.wait_ready(5))
        yield server, client
        await client.close()


async def test_concurrent_rollouts_share_one_stream_and_equal_unary_calls(
    served: tuple[FakeServer, EngineClient],
) -> None:
    server, client = served
    requests = [rollout(f"r{i}", i + 3, i + 4) for i in range(50)]
    streamed = await asyncio.gather(*(client.stream_rollout(r) for r in requests))
    assert server.engine.rollout_streams == 1 and server.engine.streamed_rollouts == 50
    for request, answer in zip(requests, streamed, strict=True):
        request.request_id += "-unary"
        unary = await client.rollout(request)
        assert answer.request_id + "-unary" == unary.request_id
        assert list(answer.token_ids) == list(unary.token_ids)
        assert list(answer.logprobs) == list(unary.logprobs)
    assert server.engine.rollout_streams == 1


async def test_a_failed_rollout_raises_its_status_and_the_stream_goes_on(
    served: tuple[FakeServer, EngineClient],
) -> None:
    server, client = served
    server.engine.fail_with = (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: bad")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stream_rollout(rollout("bad"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt_token_ids: bad"
    server.engine.fail_with = None
    assert (await client.stream_rollout(rollout("good"))).request_id == "good"
    assert server.engine.rollout_streams == 1


async def test_cancel_and_a_cancelled_waiter_abort_on_the_server(
    served: tuple[FakeServer, EngineClient],
) -> None:
    server, client = served
    server.engine.hold_rollout = True
    pending = client.stream_rollout(rollout("held-1"))
    waiter = asyncio.ensure_future(client.stream_rollout(rollout("held-2")))
    await wait_until_async(
        lambda: server.engine.running == {"held-1", "held-2"}, 5, "held-1 and held-2 running"
    )
    assert pending.cancel() and pending.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # The server cancelled both tasks: the fake's requests ended.
    await wait_until_async(lambda: not server.engine.running, 5, "no rollout running")
    server.engine.hold_rollout = False
    assert (await client.stream_rollout(rollout("after"))).request_id == "after"


async def test_oversized_request_fails_at_once_like_the_call_would() -> None:
    async with FakeServer() as server:
        client = EngineClient(server.address)
        info = await client.wait_ready(5)
        info.limits.max_message_bytes = 1024
        client.use_server_limits(info)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                client.stream_rollout(rollout("big", *range(1000)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1024 bytes" in (err.value.details() or "")
            assert (await client.stream_rollout(rollout("small"))).request_id == "small"
        finally:
            await client.close()


async def test_lost_server_fails_waiting_rollouts_unavailable_then_reconnects() -> None:
    server = FakeServer(FakeEngine(hold_rollout=True))
    await server.__aenter__()
    port = server.port
    client = EngineClient(server.address)
    await client.wait_ready(5)
    try:
        waiting = [asyncio.ensure_future(client.stream_rollout(rollout(f"w{i}"))) for i in range(4)]
        await wait_until_async(lambda: len(server.engine.running) == 4, 5, "4 rollouts running")
        await server.server.stop(grace=None)
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        codes = {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}
        assert len(codes) == 1 and codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        # A new request fails fast while nobody listens ...
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(client.stream_rollout(rollout("down")), 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... and a server back on the port is served on a new stream.
        again = FakeServer()
        again.server.add_insecure_port(f"127.0.0.1:{port}")
        async with again:
            async with asyncio.timeout(10):
                while True:
                    try:
                        answer = await client.stream_rollout(rollout("back"))
                        break
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE
                        await asyncio.sleep(0.1)
            assert answer.request_id == "back" and again.engine.rollout_streams == 1
    finally:
        await client.close()
        await server.__aexit__()


@pytest.mark.parametrize(
    ("transport", "streamed"), [("auto", True), ("stream", True), ("unary", False)]
)
async def test_the_transport_flag_chooses_how_rollouts_travel(
    transport: str, streamed: bool
) -> None:
    async with FakeServer() as server, bridge_on(server, rollout_transport=transport) as engine:
        request = {"token_ids": [4, 5], "annotations": ['rollout:{"greedy":true}']}
        chunks = [c async for c in engine.generate(request, context=Context(id="t"))]
        assert chunks[0]["engine_data"]["rollout"]["token_ids"] == [5, 6]
        assert server.engine.streamed_rollouts == (1 if streamed else 0)
        assert len(server.engine.rollouts) == 1
