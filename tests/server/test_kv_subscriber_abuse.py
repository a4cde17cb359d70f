"""Issue 12, item 4: KV-event subscribers that never read.

A real server process with a 2 s stream write watchdog and a few thousand
cached blocks; 200 ``SubscribeKvEvents(include_snapshot)`` calls from a client
that never reads (its channel holds back HTTP/2 window updates, so the server's
writes block). Past ``max_kv_subscribers`` they are refused RESOURCE_EXHAUSTED
naming the limit; those admitted are ended ABORTED by the watchdog, after which
the server has no subscriber left (``max_kv_subscribers`` new ones are admitted
again, and not one more); the server's memory stays bounded and GetLoad, asked
by another process, keeps answering.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from engine_contract.retry import LIMIT_TRAILER
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import snapshot_blocks
from harness.procs import ProcessGroup
from harness.waits import wait_until_probe_async
from tests.faults.faults_common import record
from tests.server.abuse_common import GetLoadProbe, PeakRss, server_cost

pytestmark = [pytest.mark.serial, pytest.mark.slow]

WATCHDOG_S = 2.0
SUBSCRIBERS = 200
PROMPTS = 64  # of 1024 tokens: 64 blocks of 16 each
MB = 1e6


def distinct_prompt(seed: int) -> list[int]:
    """1024 tokens whose first differs per seed: no block shared with another prompt."""
    return [3 + seed] + [(seed * 7919 + i * 31) % 30_000 + 3 for i in range(1023)]


async def fill_prefix_cache(stub: pb_grpc.EngineServiceStub) -> None:
    call = stub.Rollouts()
    await call.write(
        pb.RolloutsRequest(
            start=[
                pb.RolloutStart(
                    tag=i,
                    rollout=pb.RolloutRequest(
                        request_id=f"fill-{i}",
                        prompt_token_ids=distinct_prompt(i),
                        max_new_tokens=1,
                    ),
                )
                for i in range(PROMPTS)
            ]
        )
    )
    await call.done_writing()
    async for message in call:
        for result in message.results:
            assert result.HasField("response"), result


async def admitted(call: grpc.aio.UnaryStreamCall) -> bool:
    """Whether the server took the subscription: its headers came and it goes on (a
    refusal is a trailers-only answer, over at once)."""
    try:
        await call.wait_for_connection()
    except grpc.aio.AioRpcError:
        return False
    return not call.done()


async def limit_of(call: grpc.aio.UnaryStreamCall) -> str:
    return dict(await call.trailing_metadata() or ()).get(LIMIT_TRAILER, "")


async def subscriber_count_is_zero(stub: pb_grpc.EngineServiceStub, most: int) -> bool:
    """``most`` live subscriptions are admitted, and one more is not: no other
    subscriber was open. Those opened here are cancelled again."""
    calls = [stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest()) for _ in range(most)]
    try:
        taken = await asyncio.gather(*(admitted(c) for c in calls))
        if not all(taken):
            return False
        extra = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
        calls.append(extra)
        assert not await admitted(extra), "more subscribers admitted than max_kv_subscribers"
        assert await extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return True
    finally:
        for call in calls:
            call.cancel()


async def test_non_reading_kv_subscribers_are_capped_and_cut_off(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        engine, address = group.engine_server(
            "engine",
            "--zero-delay",
            "--stream-write-timeout-s",
            str(WATCHDOG_S),
            "--num-kv-blocks",
            "8192",
        )
        control = grpc.aio.insecure_channel(address)
        # Never reads: no window updates beyond what the first bytes need.
        lazy = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", 1024),
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        try:
            stub = pb_grpc.EngineServiceStub(control)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            most = info.limits.max_kv_subscribers
            assert 0 < most < SUBSCRIBERS, info.limits
            await fill_prefix_cache(stub)
            blocks = await asyncio.to_thread(snapshot_blocks, address)
            assert blocks >= 3000, blocks

            lazy_stub = pb_grpc.EngineServiceStub(lazy)
            with (
                GetLoadProbe(address, tmp_path / "probe.json") as probe,
                PeakRss(engine.pid) as rss,
            ):
                started = time.monotonic()
                calls = [
                    lazy_stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
                    for _ in range(SUBSCRIBERS)
                ]
                taken = await asyncio.gather(*(admitted(c) for c in calls))
                answered_s = time.monotonic() - started
                kept = [c for c, ok in zip(calls, taken, strict=True) if ok]
                refused = [c for c, ok in zip(calls, taken, strict=True) if not ok]

                # The watchdog ends every admitted one: then none is counted any more.
                await wait_until_probe_async(
                    lambda: subscriber_count_is_zero(stub, most),
                    WATCHDOG_S + 20,
                    "the watchdog to cut off the non-reading subscribers",
                    interval=0.2,
                )
                cut_off_s = time.monotonic() - started
            codes = {await c.code() for c in refused}
            limits = {await limit_of(c) for c in refused}
            assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            assert limits == {"max_kv_subscribers"}, limits
            # All 200 arrive within the watchdog's time: exactly `most` were admitted.
            if answered_s < WATCHDOG_S:
                assert len(kept) == most, (len(kept), answered_s)
            assert len(kept) >= most and len(refused) > 0, (len(kept), len(refused))

            # Reading them now drains what was buffered, then the watchdog's status.
            endings: dict[str, int] = {}
            for call in kept:
                try:
                    async with asyncio.timeout(30):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    ending = "ended without an error"
                except grpc.aio.AioRpcError as e:
                    ending = f"{e.code().name}: {e.details()}"
                endings[ending] = endings.get(ending, 0) + 1
            assert all(e.startswith("ABORTED") and "stream write timeout" in e for e in endings), (
                endings
            )

            record(
                "abuse_kv_subscribers",
                cached_blocks=blocks,
                subscribers=SUBSCRIBERS,
                admitted=len(kept),
                refused=len(refused),
                all_cut_off_after_s=round(cut_off_s, 2),
                **server_cost(rss, probe),
            )
            assert rss.growth_mb < 150, (
                f"server RSS grew {rss.growth_mb:.0f} MB ({rss.base / MB:.0f} MB before) "
                f"with {len(kept)} non-reading snapshot subscribers over {blocks} blocks"
            )
            assert not probe.result["errors"], probe.summary(since=started)
            assert probe.worst_ms < 500, probe.summary(since=started)
            # Still serving: a snapshot reads whole.
            assert await asyncio.to_thread(snapshot_blocks, address) == blocks
            engine.check_alive()
        finally:
            await lazy.close()
            await control.close()
