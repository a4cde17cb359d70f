"""Item 3: Dynamo's frontend is killed (SIGKILL) and restarted on the same port:
requests it had in flight are aborted in the engines, the bridges are discovered
again and rollouts resume on both of them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from harness.engine import idle, wait_load
from harness.http import post_rollout
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver
from tests.faults.faults_common import LONG_SIM_ARGS, prompt, record

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-frontend-restart"
IN_FLIGHT = 16


async def workers_serving(session: aiohttp.ClientSession, base: str, tries: int) -> set[str]:
    """Instance ids of the engines that answered ``tries`` rollouts (round-robin)."""
    seen: set[str] = set()
    for i in range(tries):
        answer = await post_rollout(session, base, MODEL, prompt(300 + i), max_tokens=2)
        assert answer.status == 200, (answer.status, answer.body)
        seen.add(driver.parse_rollout_response(answer.body).instance_id)
    return seen


async def test_a_killed_frontend_frees_the_engines_and_a_restarted_one_serves_the_same_workers(
    tmp_path: Path, model_dir: Path
) -> None:
    port = free_port()
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        addresses = []
        for i in range(2):
            _, address = stack.start_engine(f"engine-{i}", *LONG_SIM_ARGS)
            stack.start_bridge(f"bridge-{i}", address)
            addresses.append(address)
        frontend = stack.start_frontend(port=port)
        stack.wait_serving(workers=2)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            before = await workers_serving(session, stack.base_url, 4)
            assert len(before) == 2
            tasks = [
                asyncio.create_task(
                    post_rollout(session, stack.base_url, MODEL, prompt(i), max_tokens=1500)
                )
                for i in range(IN_FLIGHT)
            ]
            await asyncio.to_thread(
                lambda: [
                    wait_load(a, lambda load: load.running_requests >= IN_FLIGHT // 2, 60)
                    for a in addresses
                ]
            )
            frontend.kill()
            killed = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(o.status == 0 for o in outcomes), [o.status for o in outcomes]
            # The bridges saw the requests' streams go and aborted them in the engines.
            await asyncio.gather(*(asyncio.to_thread(wait_load, a, idle, 30) for a in addresses))
            engines_idle_after_kill = time.monotonic() - killed
            for proc in stack.procs:
                if proc is not frontend:
                    proc.check_alive()

            restarted = time.monotonic()
            stack.start_frontend(port=port)
            stack.wait_serving(workers=2)
            after = await workers_serving(session, stack.base_url, 4)
            resumed_s = time.monotonic() - restarted
            assert after == before, (before, after)

        record(
            "frontend_restart",
            in_flight=IN_FLIGHT,
            engines_idle_after_frontend_kill_s=round(engines_idle_after_kill, 2),
            rollouts_resumed_after_frontend_start_s=round(resumed_s, 2),
        )
