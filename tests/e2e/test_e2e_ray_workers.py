"""Generation workers in real Ray actors, as RL frameworks host them.

A local Ray cluster (this machine's CPUs, no dashboard) runs
``engine_server.ray_worker.DynamoEngineActor`` actors; each owns its engine on
the actor's loop, its bridge a child of the actor's worker process. A real
Dynamo frontend (file discovery) serves them. However an actor ends (``ray.kill``,
Ray's graceful exits, SIGTERM to its worker), its model must leave discovery
within seconds and no process of its tree may stay behind. A trainer finds the
actors' workers through discovery (``rl_client.fleet_discovery``) to refit them,
and a replacement actor takes no rollout before it serves the fleet's committed
weights (``bridge/catch_up.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness import waits
from harness.checkpoints import tiny_weights_dir
from harness.env import importable
from harness.http import http_json
from harness.listeners import process_tree
from harness.metrics import scrape
from harness.ports import free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until
from rl_client import driver
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
)
from rl_client.fleet_discovery import FileFleetDiscovery, FleetWorker
from rl_client.refit import EngineRefitClient, RefitClient

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

ray = pytest.importorskip("ray")

from engine_server.ray_worker import DynamoEngineActor, WorkerStatus  # noqa: E402

SIM_ARGS = ("--backend", "sim", "--decode-step-ms", "2", "--eos-rate", "0")
# A bridge that Ray SIGKILLs stays listed until file discovery's TTL ends (some
# 12 s, measured): under 5 s tells a bridge that left apart from one that was killed.
LEAVE_BOUND_S = 5.0
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster, as small and quick to start as Ray allows."""
    previous = signal.getsignal(signal.SIGTERM)  # ray.init replaces pytest's
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            address="local",  # a cluster of its own, whatever RAY_ADDRESS says
            num_cpus=min(2, os.cpu_count() or 1),
            num_gpus=0,
            include_dashboard=False,
            object_store_memory=100 << 20,
        )
        try:
            yield
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def ray_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, ray_cluster: None
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ray-workers")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, "ray-worker")
        stack.start_frontend()
        yield stack


@pytest.fixture
def actors() -> Iterator[list[Any]]:
    """Actors a test started; any still alive at its end is killed."""
    started: list[Any] = []
    yield started
    for actor in started:
        try:
            ray.kill(actor)
        except Exception:  # dead already
            pass


def worker_actor(
    stack: Stack,
    actors: list[Any],
    name: str,
    *,
    model_dir: Path | None = None,
    namespace: str | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """A worker actor serving ``name`` (in a namespace of its own by default), not
    started yet. ``env``: more of its bridge's environment (DYN_SYSTEM_PORT)."""
    actor = DynamoEngineActor.remote(
        model_path=str(model_dir or stack.model_dir),
        served_model_name=name,
        namespace=namespace or "ns" + "".join(c for c in name if c.isalnum()),
        # The stack's Dynamo settings; the bridge cannot import vllm or torch.
        engine_env=stack.bridge_env(**(env or {})),
        exit_after_engine_gone_s=5.0,
        **kwargs,
    )
    actors.append(actor)
    return actor


def start_worker(
    stack: Stack, actors: list[Any], name: str, *, timeout: float = 120, **kwargs: Any
) -> tuple[Any, WorkerStatus]:
    """A worker actor serving ``name`` in a namespace of its own, once listed."""
    actor = worker_actor(stack, actors, name, **kwargs)
    status = ray.get(actor.start.remote(), timeout=timeout)
    stack.wait_models([name], timeout=60)
    return actor, status


def running(pid: int | None) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def death_cause(actor_id: str) -> str:
    """Ray's death cause of a dead actor (the GCS's own record; the public state
    API needs the dashboard, which this cluster does not run)."""
    from ray._private.state import actors as actor_table

    info = wait_until(
        lambda: (i := actor_table(actor_id)) and i["State"] == "DEAD" and i,
        30,
        "actor DEAD in the GCS",
    )
    return str(info["DeathCause"].actor_died_error_context.error_message)


def unlisted(stack: Stack, name: str) -> Callable[[], bool]:
    """The frontend answers and no longer lists ``name`` (a frontend that does not
    answer lists nothing, which must not pass for the model's leaving)."""

    def check() -> bool:
        status, body = http_json(f"{stack.base_url}/v1/models", timeout=5)
        return status == 200 and name not in [m["id"] for m in body.get("data", [])]

    return check


def exited(pid: int | None) -> Callable[[], bool]:
    return lambda: not running(pid)


def timeline(events: dict[str, Callable[[], bool]], timeout: float = 30) -> dict[str, float]:
    """Seconds from now until each event was first seen, all polled together."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < len(events):
        for what, happened in events.items():
            if what not in seen and happened():
                seen[what] = time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout}s: {set(events) - set(seen)} (seen {seen})")
        time.sleep(0.01)
    return seen


def tree_exited(pids: set[int]) -> dict[str, Callable[[], bool]]:
    return {f"pid {pid} exited": exited(pid) for pid in pids}


async def rollout(stack: Stack, name: str) -> driver.RolloutResult:
    async with driver.RolloutClient(stack.base_url, name, timeout_s=120) as client:
        return await client.rollout(PROMPT, greedy=True, max_tokens=16)


async def test_a_sim_worker_actor_serves_rollouts_from_its_own_engine(
    ray_stack: Stack, actors: list[Any]
) -> None:
    actor, status = start_worker(ray_stack, actors, "ray-sim", engine_args=SIM_ARGS)
    assert status.serving and status.reason == "" and status.restarts == 0
    assert status.address is not None and status.address.startswith("unix:")
    assert status.weight_version == "default"
    # The bridge is the actor's own child; its engine server is on the actor's loop.
    assert status.bridge_pid in process_tree(status.pid)
    assert ray.get(actor.address.remote()) == status.address
    assert ray.get(actor.weight_version.remote()) == "default"

    through = await rollout(ray_stack, "ray-sim")
    assert len(through.token_ids) == 16
    assert (await rollout(ray_stack, "ray-sim")).token_ids == through.token_ids
    # The same rollout asked of the actor's engine server directly.
    with grpc.insecure_channel(status.address) as channel:
        direct = pb_grpc.EngineServiceStub(channel).Rollout(
            pb.RolloutRequest(
                request_id="direct", prompt_token_ids=PROMPT, greedy=True, max_new_tokens=16
            ),
            timeout=30,
        )
    assert through.token_ids == list(direct.token_ids)
    assert [struct.pack("<d", x) for x in through.logprobs] == [
        struct.pack("<d", x) for x in direct.logprobs
    ]

    # stop(): the bridge leaves, the server drains; the actor lives on.
    ray.get(actor.stop.remote(), timeout=60)
    seen = timeline(
        {"unlisted": unlisted(ray_stack, "ray-sim"), "bridge": exited(status.bridge_pid)}
    )
    assert seen["unlisted"] < LEAVE_BOUND_S, seen
    stopped = ray.get(actor.status.remote(), timeout=30)
    assert not stopped.serving and stopped.reason == "stopped" and stopped.bridge_pid is None


def test_ray_kill_takes_the_model_out_of_discovery_and_leaves_no_process(
    ray_stack: Stack, actors: list[Any]
) -> None:
    actor, status = start_worker(ray_stack, actors, "ray-kill", engine_args=SIM_ARGS)
    tree = process_tree(status.pid)
    assert status.bridge_pid in tree
    assert status.address is not None
    folder = Path(status.address.removeprefix("unix:")).parent  # its socket's 0700 folder
    ray.kill(actor)
    seen = timeline({"unlisted": unlisted(ray_stack, "ray-kill"), **tree_exited(tree)})
    print(f"ray.kill: {seen}")
    assert seen["unlisted"] < LEAVE_BOUND_S, seen
    wait_until(lambda: not folder.exists(), 10, "socket folder removed", [])
    assert "killed by `ray.kill`" in death_cause(actor._actor_id.hex())


# Ray's own words for each exit in the actor's death cause.
GRACEFUL_EXITS = {
    "exit_actor": "INTENDED_USER_EXIT",
    "ray_terminate": "INTENDED_USER_EXIT",
    "out_of_scope": "all references to the actor were removed",
    "sigterm": "The process receives a SIGTERM",
}


@pytest.mark.parametrize("how", list(GRACEFUL_EXITS))
def test_a_graceful_actor_exit_runs_rays_exit_and_the_bridge_leaves_first(
    ray_stack: Stack, actors: list[Any], how: str
) -> None:
    name = f"ray-{how.replace('_', '-')}"
    actor, status = start_worker(ray_stack, actors, name, engine_args=SIM_ARGS)
    assert status.bridge_pid is not None
    actor_id = actor._actor_id.hex()
    tree = process_tree(status.pid)
    if how == "exit_actor":  # stop(), then Ray's exit_actor() from within
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.stop.remote(exit_actor=True), timeout=60)
    elif how == "ray_terminate":  # Ray's graceful termination, as an actor call
        actor.__ray_terminate__.remote()
    elif how == "out_of_scope":  # the driver drops its last handle
        actors.remove(actor)
        del actor
    else:  # what Ray's worker does on SIGTERM: its handler, then its exit path
        os.kill(status.pid, signal.SIGTERM)
    seen = timeline(
        {
            "unlisted": unlisted(ray_stack, name),
            "bridge": exited(status.bridge_pid),
            "actor": exited(status.pid),
            **tree_exited(tree),
        }
    )
    print(f"{how}: {seen}")
    assert seen["unlisted"] < LEAVE_BOUND_S, seen
    assert seen["bridge"] <= seen["actor"], seen
    cause = death_cause(actor_id)
    assert GRACEFUL_EXITS[how] in cause, cause


def listed_workers(discovery: FileFleetDiscovery, count: int) -> list[FleetWorker]:
    return wait_until(
        lambda: found if len(found := discovery.workers()) == count else None,
        60,
        f"{count} workers in discovery",
    )


async def test_the_fleet_refit_finds_its_ray_workers_through_discovery(
    ray_stack: Stack, actors: list[Any]
) -> None:
    """Two worker actors; the trainer's refit clients are built from discovery (no
    URL list), refit both; once one actor is killed, discovery drops it within
    seconds and the next refit reaches the other only."""
    name, namespace = "ray-fleet", "nsrayfleet"
    ports = [free_system_port(), free_system_port()]
    fleet = [
        worker_actor(
            ray_stack,
            actors,
            name,
            namespace=namespace,
            env={"DYN_SYSTEM_PORT": str(port)},
            engine_args=SIM_ARGS,
        )
        for port in ports
    ]
    statuses = ray.get([actor.start.remote() for actor in fleet], timeout=120)
    discovery = FileFleetDiscovery(ray_stack.kv_dir, namespace)
    listed = listed_workers(discovery, 2)
    # What each bridge published: its actor's engine server and its system port.
    assert {w.engine_address for w in listed} == {s.address for s in statuses}
    assert {w.admin_url for w in listed} == {f"http://127.0.0.1:{p}" for p in ports}
    assert {w.model for w in listed} == {name}
    ray_stack.wait_models([name], timeout=60)

    store = FileCommittedStore(ray_stack.kv_dir, namespace)
    started_on = CommittedWeights("0", CheckpointSource(str(ray_stack.model_dir)))
    step_1 = str(tiny_weights_dir(1))
    # Over the RL admin routes: the workers' admin URLs from discovery.
    async with RefitClient.from_discovery(
        namespace, discovery=discovery, committed=started_on, store=store
    ) as trainer:
        assert set(trainer.worker_urls) == {w.admin_url for w in listed}
        report = await trainer.refit(step_1, "1")
    assert report.ok, report.describe()
    assert ray.get([actor.weight_version.remote() for actor in fleet]) == ["1", "1"]
    result = await rollout(ray_stack, name)
    assert result.weight_versions == [("1", 0, len(result.token_ids))]
    # Over the contract: the engine servers' addresses from discovery.
    async with EngineRefitClient.from_discovery(
        namespace, discovery=discovery, store=store
    ) as engines:
        assert set(engines.engines) == {s.address for s in statuses}
        report = await engines.refit("2", path=str(ray_stack.model_dir))
    assert report.ok, report.describe()
    assert ray.get([actor.weight_version.remote() for actor in fleet]) == ["2", "2"]

    # ray.kill: that worker leaves the discovery answer within seconds.
    survivor = statuses[0].address
    assert len(discovery.workers()) == 2
    ray.kill(fleet[1])
    seen = timeline(
        {"dropped": lambda: [w.engine_address for w in discovery.workers()] == [survivor]}
    )
    print(f"ray.kill: out of the discovery answer after {seen['dropped']:.2f}s")
    assert seen["dropped"] < LEAVE_BOUND_S, seen
    # The next step's refit, built from discovery again, reaches the survivor only.
    async with RefitClient.from_discovery(namespace, discovery=discovery, store=store) as trainer:
        assert len(trainer.worker_urls) == 1
        report = await trainer.refit(step_1, "3")
    assert report.ok, report.describe()
    assert ray.get(fleet[0].weight_version.remote()) == "3"


@dataclass
class Sample:
    at: float
    listed: bool
    # The engine's declared weight version (None: still its start checkpoint).
    version: str | None
    # Requests the engine holds (a paused engine holds every one it was sent).
    requests: int


class Sampler(waits.Sampler[Sample]):
    """Discovery, then the engine's own state, every 10 ms: a sample listed with its
    engine on another version is a worker in the pool too early."""

    def __init__(self, discovery: FileFleetDiscovery, address: str) -> None:
        self.discovery = discovery
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.EngineServiceStub(self.channel)
        super().__init__(self._take, on_close=self.channel.close)

    def _take(self) -> Sample:
        listed = bool(self.discovery.workers())
        try:
            load = self.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
        except grpc.RpcError:
            load = None
        version, requests = None, 0
        if load is not None:
            state = load.refit_state
            version = state.weight_version if state.weight_version_declared else None
            requests = load.registered_requests
        return Sample(time.monotonic(), listed, version, requests)

    def first(self, check: Callable[[Sample], bool]) -> float | None:
        return next((s.at for s in self.samples if check(s)), None)


async def test_a_replacement_ray_worker_catches_up_before_it_serves(
    ray_stack: Stack, actors: list[Any]
) -> None:
    """The fleet committed "7" (a checkpoint, in the record); a replacement actor's
    engine starts on its own checkpoint, paused. Its bridge loads "7" and only then
    registers: no sample sees it in discovery before its engine serves "7", no
    request reaches the engine before, and every rollout it serves is on "7"."""
    name, namespace, committed = "ray-catchup", "nsraycatchup", "7"
    store = FileCommittedStore(ray_stack.kv_dir, namespace)
    weights = CommittedWeights(committed, CheckpointSource(str(tiny_weights_dir(1))))
    store.publish(CommittedRecord.now(weights, ["the-worker-it-replaces"]))
    port = free_system_port()
    actor = worker_actor(
        ray_stack,
        actors,
        name,
        namespace=namespace,
        env={"DYN_SYSTEM_PORT": str(port)},
        engine_args=(*SIM_ARGS, "--start-paused"),
    )
    started = time.monotonic()
    status = await asyncio.to_thread(ray.get, actor.start.remote(), timeout=120)
    assert status.address is not None
    # Its engine serves, paused, its start checkpoint; its bridge is only starting.
    assert status.weight_version == "default"
    discovery = FileFleetDiscovery(ray_stack.kv_dir, namespace)
    results: list[driver.RolloutResult] = []
    stop = asyncio.Event()

    async def drive(client: driver.RolloutClient) -> None:
        """Rollouts all along: refused while the model is not listed (404), then served."""
        while not stop.is_set():
            try:
                results.append(await client.rollout(PROMPT, greedy=True, max_tokens=8))
            except driver.RolloutHTTPError as e:
                if e.status != 404:
                    raise
                await asyncio.sleep(0.05)

    with Sampler(discovery, status.address) as sampler:
        async with driver.RolloutClient(ray_stack.base_url, name, timeout_s=60) as client:
            task = asyncio.ensure_future(drive(client))
            for _ in range(600):  # a minute at most
                if len(results) >= 10 or task.done():
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await task
    samples = sampler.samples
    too_early = [s for s in samples if s.listed and s.version != committed]
    assert not too_early, too_early[:5]
    reached_early = [s for s in samples if s.version != committed and s.requests]
    assert not reached_early, reached_early[:5]
    on_committed = sampler.first(lambda s: s.version == committed)
    listed = sampler.first(lambda s: s.listed)
    assert on_committed is not None and listed is not None
    assert samples[0].version is None and not samples[0].listed, samples[0]
    assert on_committed <= listed
    assert len(results) >= 10
    assert all(r.weight_versions == [(committed, 0, len(r.token_ids))] for r in results)
    # The bridge's own measure of its catch-up (loaded the committed checkpoint).
    metrics = scrape(f"http://127.0.0.1:{port}/metrics")
    assert metrics.value("bridge_catch_up_seconds_count", source="checkpoint") == 1
    catch_up_s = metrics.value("bridge_catch_up_seconds_sum", source="checkpoint")
    print(
        f"catch-up: {catch_up_s:.3f}s (bridge_catch_up_seconds); engine on {committed!r} "
        f"{on_committed - started:.2f}s after the actor's start, in discovery "
        f"{listed - on_committed:.2f}s later; {len(results)} rollouts, all on {committed!r}"
    )


@pytest.mark.vllm
@pytest.mark.skipif(not importable("vllm"), reason="needs vLLM")
async def test_a_vllm_asyncllm_in_a_ray_actor_serves_a_rollout(
    ray_stack: Stack, actors: list[Any]
) -> None:
    actor, status = start_worker(
        ray_stack,
        actors,
        "ray-vllm",
        model_dir=tiny_model_dir("base"),  # a base checkpoint: no chat template
        vllm_engine_args={
            "enforce_eager": True,
            "dtype": "float32",
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 64 << 20,
        },
        timeout=300,
    )
    assert status.serving and status.weight_version == "default"
    result = await rollout(ray_stack, "ray-vllm")
    assert 1 <= len(result.token_ids) <= 16
    assert len(result.logprobs) == len(result.token_ids)
    # Its EngineCore is in the actor's tree; nothing of it outlives the actor.
    tree = process_tree(status.pid)
    assert len(tree) >= 3, tree  # the actor, its bridge, vLLM's EngineCore
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.stop.remote(exit_actor=True), timeout=120)
    seen = timeline({"unlisted": unlisted(ray_stack, "ray-vllm"), **tree_exited(tree)})
    assert seen["unlisted"] < LEAVE_BOUND_S, seen
