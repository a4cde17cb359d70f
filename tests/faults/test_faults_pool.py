"""Registration follows the engine: a worker whose engine server is gone leaves the
router's pool, and rejoins when an engine server serves at its address again.

Two workers, the frontend without migration (``--migration-limit 0``): once the
bridge noticed its engine server died, every request goes to the survivor and
succeeds; the restarted engine server gets traffic again once its bridge
rejoined.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from harness.http import post_rollout
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.stack import Stack, registered_workers
from harness.waits import wait_until
from rl_client import driver
from tests.faults.faults_common import prompt, record

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-pool"
SIM_ARGS = ("--decode-step-ms", "1", "--eos-rate", "0")


async def test_a_dead_engine_leaves_the_pool_and_its_restart_rejoins(
    tmp_path: Path, model_dir: Path
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        first, address = stack.start_engine("engine-0", *SIM_ARGS, listen=listen)
        stack.start_bridge("bridge-0", address)
        _, survivor = stack.start_engine("engine-1", *SIM_ARGS)
        stack.start_bridge("bridge-1", survivor)
        stack.start_frontend("--migration-limit", "0")
        stack.wait_serving(workers=2)

        def workers() -> int:
            return registered_workers(stack.kv_dir, stack.namespace)

        first.kill()
        killed = time.monotonic()
        wait_until(lambda: workers() == 1, 5, "the dead engine's worker left the pool", [])
        left_s = time.monotonic() - killed
        async with aiohttp.ClientSession() as session:
            outcomes = await asyncio.gather(
                *(post_rollout(session, stack.base_url, MODEL, prompt(i), 4) for i in range(32))
            )
            assert [o.status for o in outcomes] == [200] * 32, [
                (o.status, o.body) for o in outcomes if o.status != 200
            ]
            served_by = {driver.parse_rollout_response(o.body).instance_id for o in outcomes}
            assert len(served_by) == 1  # the survivor
            # The engine server comes back at the same address: its worker rejoins.
            restarted, _ = stack.start_engine("engine-0b", *SIM_ARGS, listen=listen)
            back = time.monotonic()
            wait_until(lambda: workers() == 2, 10, "the worker rejoined", [restarted])
            rejoin_s = time.monotonic() - back
            seen: set[str] = set()
            for i in range(40):
                outcome = await post_rollout(session, stack.base_url, MODEL, prompt(100 + i), 2)
                assert outcome.status == 200, outcome.body
                seen.add(driver.parse_rollout_response(outcome.body).instance_id)
                if len(seen - served_by) >= 1:
                    break
            assert seen - served_by, "the restarted engine server got no traffic"
        record(
            "pool_follows_engine",
            left_pool_after_kill_s=round(left_s, 2),
            rejoined_after_restart_s=round(rejoin_s, 2),
        )
