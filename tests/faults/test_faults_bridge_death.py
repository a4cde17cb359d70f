"""Item 2: the bridge dies (SIGKILL) with 64+ requests in flight.

The engine server aborts them all (0 running within 1 s); a new bridge
registers, gets a snapshot of the engine's cached blocks over the KV stream,
and KV-aware routing scores hits on those blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from harness.engine import idle, snapshot_blocks, wait_load
from harness.http import post_rollout
from harness.procs import ProcessGroup
from harness.stack import KV_ROUTER_ARGS, Stack
from harness.waits import wait_until, wait_until_probe_async
from tests.faults.faults_common import (
    KV_PROMPT,
    LONG_SIM_ARGS,
    kv_hit_rate,
    prompt,
    record,
    wait_kv_hit,
)

pytestmark = [pytest.mark.serial, pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-bridge-death"
IN_FLIGHT = 64


async def test_bridge_killed_with_requests_in_flight(tmp_path: Path, model_dir: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        engine, address = stack.start_engine("engine", *LONG_SIM_ARGS)
        bridge = stack.start_bridge("bridge-1", address)
        frontend = stack.start_frontend(*KV_ROUTER_ARGS)
        stack.wait_serving()
        base = stack.base_url

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # The engine caches KV_PROMPT's blocks (and keeps them after the request).
            await kv_hit_rate(session, base, MODEL)
            await wait_kv_hit(session, base, MODEL, KV_PROMPT)
            tasks = [
                asyncio.create_task(post_rollout(session, base, MODEL, prompt(i), max_tokens=1500))
                for i in range(IN_FLIGHT)
            ]
            await asyncio.to_thread(
                wait_load, address, lambda load: load.running_requests >= IN_FLIGHT, 60
            )
            bridge.kill()
            killed = time.monotonic()
            await asyncio.to_thread(wait_load, address, idle, 10)
            aborted_s = time.monotonic() - killed
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert all(o.status != 200 for o in outcomes), [o.status for o in outcomes]
            engine.check_alive()
            frontend.check_alive()
            cached_blocks = snapshot_blocks(address)
            assert cached_blocks > 0

            started = time.monotonic()
            bridge2 = stack.start_bridge("bridge-2", address)
            await asyncio.to_thread(
                wait_until,
                lambda: "publisher ready" in bridge2.log_tail(100_000),
                60,
                "the new bridge's KV publisher",
                [bridge2, engine, frontend],
            )
            # (The snapshot's events reach the router over ZMQ, asynchronously: ms,
            # and slack for a loaded machine.)
            await asyncio.sleep(1.0)

            hit = await wait_until_probe_async(
                lambda: kv_hit_rate(session, base, MODEL, check=False),
                60,
                "the new bridge to serve",
                interval=0.1,
                done=lambda hit: hit is not None,
            )
            serving_s = time.monotonic() - started
            # The very first request through the new bridge already scores the
            # engine's cached prefix: the router learnt it from the snapshot.
            assert hit > 0, hit

        record(
            "bridge_death",
            in_flight=IN_FLIGHT,
            engine_idle_after_bridge_kill_s=round(aborted_s, 3),
            cached_blocks_at_new_bridge=cached_blocks,
            new_bridge_serving_after_start_s=round(serving_s, 2),
            first_kv_hit_rate=hit,
        )
        assert aborted_s < 1.0, f"engine still running requests {aborted_s:.2f}s after the kill"
