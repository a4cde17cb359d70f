"""Generation workers in real Ray actors, as RL frameworks host them.

A local Ray cluster (this machine's CPUs, no dashboard) runs
``engine_server.ray_worker.DynamoEngineActor`` actors; each owns its engine on
the actor's loop, its bridge a child of the actor's worker process. A real
Dynamo frontend (file discovery) serves them. However an actor ends (``ray.kill``,
Ray's graceful exits, SIGTERM to its worker), its model must leave discovery
within seconds and no process of its tree may stay behind.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.env import importable
from harness.http import http_json
from harness.listeners import process_tree
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until
from rl_client import driver

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


def start_worker(
    stack: Stack,
    actors: list[Any],
    name: str,
    *,
    model_dir: Path | None = None,
    timeout: float = 120,
    **kwargs: Any,
) -> tuple[Any, WorkerStatus]:
    """A worker actor serving ``name`` in a namespace of its own, once listed."""
    actor = DynamoEngineActor.remote(
        model_path=str(model_dir or stack.model_dir),
        served_model_name=name,
        namespace="ns" + "".join(c for c in name if c.isalnum()),
        # The stack's Dynamo settings; the bridge cannot import vllm or torch.
        engine_env=stack.bridge_env(),
        exit_after_engine_gone_s=5.0,
        **kwargs,
    )
    actors.append(actor)
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
    ray.kill(actor)
    seen = timeline({"unlisted": unlisted(ray_stack, "ray-kill"), **tree_exited(tree)})
    print(f"ray.kill: {seen}")
    assert seen["unlisted"] < LEAVE_BOUND_S, seen
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
