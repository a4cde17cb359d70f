"""Registration follows the engine: a worker whose engine server is gone leaves the
router's pool, and rejoins when an engine server serves at its address again.

Two workers, the frontend without migration (``--migration-limit 0``): once the
bridge noticed its engine server died, every request goes to the survivor and
succeeds; the restarted engine server gets traffic again once its bridge
rejoined.

Sleep too: a worker its RL route put to sleep rejoins whenever its engine serves
again, whoever woke it (over gRPC at once, before the bridge's health watch saw
the engine down; ``control/wake_up`` on an engine already awake).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest

from bridge.registration import RECORDS_KEPT
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.http import http_json, post_rollout
from harness.ports import free_port, free_system_port
from harness.stack import Stack, registered_workers, stack_under
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
    with stack_under(tmp_path, model_dir, MODEL) as stack:
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


# -- sleep ------------------------------------------------------------------------


@dataclass
class SleepWorker:
    stack: Stack
    admin: str  # the bridge's RL routes
    engine: pb_grpc.EngineServiceStub  # the engine server itself, over gRPC

    def route(self, name: str) -> dict[str, object]:
        status, answer = http_json(f"{self.admin}/engine/{name}", {})
        assert status == 200 and answer["status"] == "ok", (name, status, answer)
        return dict(answer)

    def workers(self) -> int:
        return registered_workers(self.stack.kv_dir, self.stack.namespace)

    def slept_by_route(self) -> None:
        """Asleep through the bridge's route, and out of the pool for it."""
        assert self.route("control/sleep")["message"] == "Engine slept (level=1)"
        wait_until(lambda: self.workers() == 0, 5, "the sleeping worker left the pool", [])


@pytest.fixture(scope="module")
def sleep_worker(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[SleepWorker]:
    """One sim engine server behind one bridge (its RL routes on), file discovery."""
    with stack_under(tmp_path_factory.mktemp("pool-sleep"), model_dir, "tiny-sleep") as stack:
        _, address = stack.start_engine("engine", *SIM_ARGS)
        port = free_system_port()
        bridge = stack.start_bridge("bridge", address, DYN_SYSTEM_PORT=str(port))
        wait_until(lambda: stack.registered_workers() == 1, 60, "registered", [bridge])
        with grpc.insecure_channel(address) as channel:
            yield SleepWorker(stack, f"http://127.0.0.1:{port}", pb_grpc.EngineServiceStub(channel))


def test_a_worker_slept_by_its_route_rejoins_when_woken_over_grpc(
    sleep_worker: SleepWorker,
) -> None:
    """Woken at the engine server at once: the bridge's watch never saw two failed
    probes, yet the worker is back as soon as its engine serves."""
    w = sleep_worker
    for _ in range(3):
        w.slept_by_route()
        assert w.engine.WakeUp(pb.WakeUpRequest(), timeout=10).awake
        wait_until(lambda: w.workers() == 1, 5, "back in the pool after a wake over gRPC", [])


def test_wake_up_route_on_an_awake_engine_puts_the_worker_back(
    sleep_worker: SleepWorker,
) -> None:
    """``control/wake_up`` finds the engine awake (woken over gRPC): it answers
    once the worker is back in the pool, not merely "already awake"."""
    w = sleep_worker
    w.slept_by_route()
    assert w.engine.WakeUp(pb.WakeUpRequest(), timeout=10).awake
    assert w.route("control/wake_up")["message"] == "Engine already awake"
    assert w.workers() == 1


async def test_a_bridge_asked_to_end_stays_out_of_the_pool_while_it_drains(
    tmp_path: Path, model_dir: Path
) -> None:
    """SIGTERM: Dynamo's worker takes the endpoint out of discovery, then serves on
    through its grace period (5 s) and drain. The bridge's keeper once wrote the
    records back within half a second, so the router sent new requests to a worker
    on its way out."""
    with stack_under(tmp_path, model_dir, MODEL) as stack:
        _, address = stack.start_engine("engine", *SIM_ARGS)
        # Dynamo's default grace period (the harness's bridges have none).
        bridge = stack.start_bridge("bridge", address, DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="5")
        stack.start_frontend()
        stack.wait_serving(workers=1)

        def workers() -> int:
            return registered_workers(stack.kv_dir, stack.namespace)

        # The keeper holds the records it would write back.
        wait_until(lambda: RECORDS_KEPT in bridge.log_tail(200_000), 20, "records kept", [bridge])
        bridge.signal(signal.SIGTERM)
        wait_until(lambda: workers() == 0, 5, "the worker out of discovery", [])
        counts: list[int] = []
        while bridge.alive():
            counts.append(workers())
            await asyncio.sleep(0.1)
        assert bridge.wait_exit(30) == 0
        assert len(counts) > 30, "the bridge exited before its grace period ended"
        assert set(counts) == {0}, counts
        assert "healing" not in bridge.log_tail(200_000)
