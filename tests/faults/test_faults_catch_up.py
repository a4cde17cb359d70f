"""Issue 31 item 3: a worker that (re)starts mid-training serves only once its engine
holds the fleet's committed weights.

Two workers (sim engine server ``--start-paused`` + bridge), one frontend, a
driver sending rollouts all along. The trainer's fleet refit commits version
"1" and publishes it in the file store (``rl_client.committed``); then worker B
is restarted while the driver runs, and must not get a single rollout before
its engine serves "1":

- **a committed checkpoint** (``bridge/catch_up.py`` loads it): first B's engine
  server alone is killed and restarted (the bridge's refresh), then the whole
  worker, its host's copy of the checkpoint missing at first (a node the
  checkpoint has not reached yet): the bridge's load is refused and retried, B
  stays out of discovery, and its paused engine holds no request (one would wait
  at its gate until the resume, so a GetLoad just before the copy arrives
  proves none came) until the copy is there;
- **weights pushed by the trainer** (``rl_client.keeper``): B's bridge waits,
  unregistered, until the trainer's keeper pushes them; first with the keeper
  stopped (the same proofs over the wait), then a whole-worker restart with the
  keeper running.

Throughout, a sampler reads discovery first and B's engine version second: a
sample with B registered and its engine on another version would be B in the
pool before it caught up. Every rollout of the run carries only version "1".
Catch-up times: printed and in ``.artifacts/faults/catch_up_*.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness import waits
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.metrics import scrape
from harness.ports import free_port, free_system_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack, registered_workers
from harness.waits import wait_until, wait_until_async
from rl_client.committed import CheckpointSource, FileCommittedStore, PushedSource
from rl_client.driver import RetryPolicy, RolloutClient, RolloutResult
from rl_client.keeper import WeightKeeper
from rl_client.refit import EngineRefitClient
from rl_client.refit_report import Deadlines
from tests.faults.faults_common import prompt, record

pytestmark = [pytest.mark.serial, pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-catch-up"
NAMESPACE = "nstinycatchup"
SIM_ARGS = ("--eos-rate", "0", "--decode-step-ms", "1", "--start-paused")
HOST_ROOT = (str(Path(__file__).parent / "host_root.py"),)
# The same path on both workers, each resolving it on its own host.
CKPT = "/proc/self/cwd/ckpt/step-1"
DEADLINES = Deadlines(pause_s=30, update_s=60, rollback_s=60, control_s=30)
DRIVERS = 4


def engine_channel(address: str) -> grpc.Channel:
    """A channel of its own (not sharing a subchannel, and its reconnect backoff,
    with another), quick to reconnect to an engine server that restarts."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 200),
        ],
    )


def refit_state(channel: grpc.Channel, wait: bool = False) -> pb.GetLoadResponse | None:
    """The engine server's load and refit state; None when it does not answer."""
    try:
        answer: pb.GetLoadResponse = pb_grpc.EngineServiceStub(channel).GetLoad(
            pb.GetLoadRequest(), timeout=5, wait_for_ready=wait
        )
        return answer
    except grpc.RpcError:
        return None


@dataclass
class Worker:
    """One worker: its host folder, engine server address, system port, processes."""

    index: int
    host: Path
    listen: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    system_port: int = field(default_factory=free_system_port)
    engine: Proc | None = None
    bridge: Proc | None = None
    starts: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def checkpoint(self) -> Path:
        return self.host / "ckpt" / "step-1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}/metrics"

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (self.engine, self.bridge) if p is not None]


@dataclass
class Fleet:
    stack: Stack
    workers: list[Worker]

    def start_engine(self, worker: Worker) -> float:
        """A fresh engine server on the worker's address; when it was ready (the
        time its address was written)."""
        name = f"engine-{worker.index}-{next(worker.starts)}"
        worker.engine, _ = self.stack.start_engine(
            name,
            *SIM_ARGS,
            listen=worker.listen,
            launcher=HOST_ROOT,
            env={"FLEET_HOST_ROOT": str(worker.host)},
        )
        return (self.stack.group.log_dir / f"{name}.addr").stat().st_mtime

    def start_bridge(self, worker: Worker) -> None:
        worker.bridge = self.stack.start_bridge(
            f"bridge-{worker.index}-{len(self.stack.bridges)}",
            worker.listen,
            DYN_SYSTEM_PORT=str(worker.system_port),
        )

    def registered(self) -> int:
        return registered_workers(self.stack.kv_dir, NAMESPACE)

    @property
    def store(self) -> FileCommittedStore:
        """The fleet's committed record (a file store beside discovery's)."""
        return FileCommittedStore(self.stack.kv_dir, NAMESPACE)

    def trainer(self) -> EngineRefitClient:
        """The trainer's refit client for every worker's engine server, committing to
        the fleet's record."""
        addresses = [w.listen for w in self.workers]
        return EngineRefitClient(addresses, store=self.store, deadlines=DEADLINES)

    def wait_registered(self, count: int, procs: list[Proc], timeout: float = 60) -> None:
        wait_until(
            lambda: self.registered() == count, timeout, f"{count} workers registered", procs
        )

    def catch_up_seconds(self, worker: Worker, source: str) -> tuple[float, float]:
        """The bridge's own measure: (catch-ups, seconds in all)."""
        samples = scrape(worker.metrics_url)
        try:
            return (
                samples.value("bridge_catch_up_seconds_count", source=source),
                samples.value("bridge_catch_up_seconds_sum", source=source),
            )
        except KeyError:  # none yet
            return 0.0, 0.0


@pytest.fixture
def fleet(tmp_path: Path, model_dir: Path) -> Iterator[Fleet]:
    """Two workers serving version "1" of the checkpoint (each host has its copy),
    the record published, a frontend in front."""
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL, NAMESPACE)
        workers = [Worker(i, tmp_path / f"host-{i}") for i in range(2)]
        fleet = Fleet(stack, workers)
        for worker in workers:
            worker.host.mkdir()
            shutil.copytree(tiny_weights_dir(1), worker.checkpoint)
            fleet.start_engine(worker)
            fleet.start_bridge(worker)  # no record yet: registers at once (paused)
        stack.start_frontend()
        stack.wait_serving(workers=2, timeout=120)
        yield fleet


class Driver:
    """Rollouts through the frontend, ``DRIVERS`` at a time, until stopped: every
    result kept."""

    def __init__(self, base_url: str) -> None:
        retry = RetryPolicy(attempts=200, initial_s=0.05, max_s=0.5)
        self.client = RolloutClient(base_url, MODEL, timeout_s=60, retry=retry)
        self.results: list[RolloutResult] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._loop(i)) for i in range(DRIVERS)]

    async def _loop(self, seed: int) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            self.results.append(await self.client.rollout(prompt(seed * 1000 + n), max_tokens=8))

    async def more(self, count: int, what: str) -> None:
        """Until ``count`` more rollouts have come back."""
        target = len(self.results) + count
        await wait_until_async(lambda: len(self.results) >= target, 60, what)

    def served_by(self, instance: str) -> list[RolloutResult]:
        return [r for r in self.results if r.instance_id == instance]

    async def stop(self) -> list[BaseException]:
        """Stop (rollouts still waiting after 30 s are cancelled); what failed, so
        that a test already failing fails with its own error."""
        self._stop.set()
        done, pending = await asyncio.wait(self._tasks, timeout=30) if self._tasks else ((), ())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.client.close()
        failed = [e for t in done if (e := t.exception()) is not None]
        return failed + [TimeoutError(f"{len(pending)} rollouts still waiting")] * bool(pending)


@dataclass
class Sample:
    at: float
    registered: int
    version: str | None
    registered_requests: int
    # Whether the engine answered: right after its restart, this sampler's own channel
    # may still be in gRPC's reconnect backoff (failing at once) while the bridge's
    # has reconnected; such a sample knows nothing of the engine's version.
    answered: bool


class Sampler(waits.Sampler[Sample]):
    """Discovery first, then the engine's weight version: a sample with the worker
    registered and its engine answering on another version is a worker in the pool
    too early."""

    def __init__(self, fleet: Fleet, worker: Worker) -> None:
        self.fleet = fleet
        self.channel = engine_channel(worker.listen)
        super().__init__(self._take, on_close=self.channel.close)

    def _take(self) -> Sample:
        registered = self.fleet.registered()
        load = refit_state(self.channel)
        version = None
        if load is not None and load.refit_state.weight_version_declared:
            version = load.refit_state.weight_version
        requests = load.registered_requests if load is not None else 0
        return Sample(time.time(), registered, version, requests, load is not None)

    def too_early(self, committed: str) -> list[Sample]:
        return [
            s for s in self.samples if s.registered == 2 and s.answered and s.version != committed
        ]

    async def check_joined(self, committed: str) -> None:
        """Once a sample saw the worker registered: none saw it so before its engine
        served ``committed``."""
        await wait_until_async(
            lambda: any(s.registered == 2 for s in self.samples), 10, "a sample registered"
        )
        self.check_none_too_early(committed)

    def check_none_too_early(self, committed: str) -> None:
        """No sample saw the worker registered before its engine served ``committed``."""
        assert not self.too_early(committed), self.too_early(committed)[:5]

    def first_registered(self) -> float:
        return next(s.at for s in self.samples if s.registered == 2)


def stop_worker(fleet: Fleet, worker: Worker) -> None:
    """The whole worker down: its engine killed (the rollouts on it fail, retryable),
    then, once out of the pool, its bridge stopped (leaving discovery; stopped with
    rollouts in flight, it would cancel them: HTTP 499, which no driver retries)."""
    assert worker.engine is not None and worker.bridge is not None
    others = [p for w in fleet.workers if w is not worker for p in w.procs]
    worker.engine.kill()
    fleet.wait_registered(len(fleet.workers) - 1, [*others, worker.bridge])
    worker.bridge.stop()


def assert_all_on(results: list[RolloutResult], version: str) -> None:
    wrong = [
        (r.instance_id, r.weight_versions)
        for r in results
        if r.weight_versions != [(version, 0, len(r.token_ids))]
    ]
    assert not wrong, wrong[:5]


def instance(worker: Worker) -> str:
    with engine_channel(worker.listen) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, wait_for_ready=True)
        return str(info.instance_id)


async def rejoined(
    fleet: Fleet, worker: Worker, sampler: Sampler, driver: Driver, what: str
) -> str:
    """The worker back in the pool: both registered, no sample saw it so before its
    engine served "1", then ``what`` (a rollout served by its new engine server);
    that server's instance id."""
    procs = [p for w in fleet.workers for p in w.procs]
    await asyncio.to_thread(fleet.wait_registered, 2, procs)
    await sampler.check_joined("1")
    served = instance(worker)
    await wait_until_async(lambda: driver.served_by(served), 60, what)
    return served


def end_of_run(
    name: str, driver: Driver, failed: list[BaseException], instances: list[str], **figures: Any
) -> None:
    """No rollout of the run failed, every one on version "1", and each of B's
    engine servers (``instances``) served some; then the run's figures recorded
    under ``name``."""
    assert not failed, failed
    assert_all_on(driver.results, "1")
    assert all(driver.served_by(i) for i in instances)
    record(name, rollouts=len(driver.results), **figures)


async def test_a_restarted_worker_loads_the_committed_checkpoint_before_it_serves(
    fleet: Fleet,
) -> None:
    a, b = fleet.workers
    async with fleet.trainer() as trainer:
        await trainer.refit("1", path=CKPT)
    committed = fleet.store.read()
    assert committed is not None and committed.weights.source == CheckpointSource(CKPT)
    driver = Driver(fleet.stack.base_url)
    driver.start()
    try:
        await driver.more(20, "rollouts before the fault")

        # 1. B's engine server killed and restarted (the bridge stays: its refresh).
        assert b.engine is not None
        b.engine.kill()
        await asyncio.to_thread(fleet.wait_registered, 1, [a.engine, a.bridge, b.bridge])
        before = fleet.catch_up_seconds(b, "checkpoint")
        with Sampler(fleet, b) as restart:
            ready = await asyncio.to_thread(fleet.start_engine, b)
            first = await rejoined(fleet, b, restart, driver, "a rollout served by B's new engine")
        after = fleet.catch_up_seconds(b, "checkpoint")
        restart.check_none_too_early("1")
        assert after[0] == before[0] + 1
        engine_restart = {
            "bridge_catch_up_s": round(after[1] - before[1], 4),
            "engine_ready_to_registered_s": round(restart.first_registered() - ready, 3),
        }

        # 2. The whole worker restarted, its copy of the checkpoint not there yet.
        assert b.bridge is not None and b.engine is not None
        await asyncio.to_thread(stop_worker, fleet, b)
        aside = b.host / "step-1.arriving"
        b.checkpoint.rename(aside)
        with Sampler(fleet, b) as restart:
            await asyncio.to_thread(fleet.start_engine, b)
            fleet.start_bridge(b)
            assert b.bridge is not None
            await asyncio.to_thread(
                wait_until,
                lambda: f"{CKPT} as '1' failed" in b.bridge.log_tail(20_000) if b.bridge else False,
                60,
                "B's bridge to fail loading the missing checkpoint",
                b.procs,
            )
            window_started = time.monotonic()
            await driver.more(200, "rollouts while B waits for its checkpoint")
            with engine_channel(b.listen) as channel:
                held = refit_state(channel, wait=True)
            assert held is not None
            # Paused on its start weights, and not one request reached it: one
            # would wait at its gate, registered, until the resume.
            assert held.refit_state.paused and not held.refit_state.weight_version_declared
            assert held.registered_requests == 0
            assert fleet.registered() == 1
            window_s = time.monotonic() - window_started
            aside.rename(b.checkpoint)  # the checkpoint arrives
            arrived = time.time()
            second = await rejoined(fleet, b, restart, driver, "a rollout served by the new worker")
        restart.check_none_too_early("1")
        assert all(s.registered_requests == 0 for s in restart.samples if s.version is None)
        worker_restart = {
            "window_s": round(window_s, 2),
            "checkpoint_arrived_to_registered_s": round(restart.first_registered() - arrived, 3),
        }
    finally:
        failed = await driver.stop()
    end_of_run(
        "catch_up_checkpoint",
        driver,
        failed,
        [first, second],
        engine_restart=engine_restart,
        worker_restart=worker_restart,
    )


async def test_a_restarted_worker_waits_for_the_trainers_keeper_to_push_its_weights(
    fleet: Fleet,
) -> None:
    a, b = fleet.workers
    tensors = checkpoint_tensors(tiny_weights_dir(1))
    driver = Driver(fleet.stack.base_url)
    async with fleet.trainer() as trainer:
        await trainer.refit("1", tensors=tensors)
        committed = fleet.store.read()
        assert committed is not None and committed.weights.source == PushedSource()
        keeper = WeightKeeper(trainer)
        driver.start()
        try:
            await driver.more(20, "rollouts before the fault")

            # 1. B's engine server restarted, the keeper not running: B waits.
            assert b.engine is not None and b.bridge is not None
            b.engine.kill()
            await asyncio.to_thread(fleet.wait_registered, 1, [a.engine, a.bridge, b.bridge])
            with Sampler(fleet, b) as restart:
                await asyncio.to_thread(fleet.start_engine, b)
                await asyncio.to_thread(
                    wait_until,
                    lambda: (
                        "waiting for its keeper" in b.bridge.log_tail(20_000) if b.bridge else False
                    ),
                    60,
                    "B's bridge to wait for the trainer's push",
                    b.procs,
                )
                await driver.more(200, "rollouts while B waits for the push")
                with engine_channel(b.listen) as channel:
                    held = refit_state(channel, wait=True)
                assert held is not None and held.refit_state.paused
                assert not held.refit_state.weight_version_declared
                assert held.registered_requests == 0 and fleet.registered() == 1
                keeper.start()
                started = time.time()
                first = await rejoined(
                    fleet, b, restart, driver, "a rollout served by B's new engine"
                )
            restart.check_none_too_early("1")
            assert keeper.pushes == 1 and keeper.last_push_s is not None
            late_keeper = {
                "keeper_push_s": round(keeper.last_push_s, 4),
                "keeper_started_to_registered_s": round(restart.first_registered() - started, 3),
            }

            # 2. The whole worker restarted, the keeper running.
            await asyncio.to_thread(stop_worker, fleet, b)
            with Sampler(fleet, b) as restart:
                ready = await asyncio.to_thread(fleet.start_engine, b)
                fleet.start_bridge(b)
                second = await rejoined(
                    fleet, b, restart, driver, "a rollout served by the new worker"
                )
            restart.check_none_too_early("1")
            assert keeper.pushes == 2
            count, seconds = fleet.catch_up_seconds(b, "pushed")  # the new bridge's one
            assert count == 1
            worker_restart = {
                "keeper_push_s": round(keeper.last_push_s, 4),
                "bridge_catch_up_s": round(seconds, 4),
                "engine_ready_to_registered_s": round(restart.first_registered() - ready, 3),
            }
        finally:
            await keeper.close()
            failed = await driver.stop()
    end_of_run(
        "catch_up_pushed",
        driver,
        failed,
        [first, second],
        engine_restart_keeper_started_late=late_keeper,
        worker_restart=worker_restart,
    )
