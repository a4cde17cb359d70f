"""The generation workers the demo trains through, and the fault it puts them through.

Two shapes, one interface (``Workers``), each behind a Dynamo frontend:

- ``RayFleet`` (the default): N generation workers hosted in Ray actors
  (``engine_server.ray_worker.DynamoEngineActor``: a vLLM engine server on the
  actor's loop, its bridge a child), on a local Ray cluster of this machine's
  CPUs, behind a frontend routing by KV overlap (``--router-mode kv``). The
  fault: the worker holding the step's rollouts is killed with ``ray.kill`` and
  a new actor, on a new address, is started in its place; it comes up
  paused on its start checkpoint and joins once caught up (``loop.py``).
- ``ProcessStack`` (``--single``): one engine server process and one bridge
  process. The fault: the engine server is SIGKILLed and restarted on its
  address.

Every engine server runs with ``--start-paused``: whatever engine serves, it
serves nothing until the trainer's weights are on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import tiny_vllm_args
from harness.ports import free_port
from harness.procs import Proc, ProcessGroup
from harness.stack import KV_ROUTER_ARGS, Stack

log = logging.getLogger(__name__)

MODEL = "policy"
# The engine servers' flags (after ``--backend vllm``): the tiny model in fp32,
# paused until the trainer's weights are loaded.
ENGINE_ARGS = (*tiny_vllm_args(max_model_len=512), "--block-size", "32", "--start-paused")
START_TIMEOUT_S = 300.0


def instance_id(address: str) -> str:
    """The engine server's instance id (new with every start)."""
    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.EngineServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=10
        )
    return str(info.instance_id)


@contextlib.asynccontextmanager
async def engine_stubs(addresses: list[str]) -> AsyncIterator[list[pb_grpc.EngineServiceStub]]:
    """An asyncio stub per engine server, their channels closed after."""
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        yield [pb_grpc.EngineServiceStub(c) for c in channels]
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def hold(addresses: list[str]) -> None:
    """Pause every engine server, ``PAUSE_MODE_KEEP``: rollouts sent now wait in it,
    registered, until it resumes (``release``) or dies."""
    request = pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP, clear_cache=False)
    async with engine_stubs(addresses) as stubs:
        await asyncio.gather(*(s.PauseGeneration(request, timeout=10) for s in stubs))


async def release(addresses: list[str]) -> None:
    """Resume the engine servers ``hold`` paused."""
    async with engine_stubs(addresses) as stubs:
        await asyncio.gather(
            *(s.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10) for s in stubs)
        )


async def held_by(
    addresses: list[str], rollouts: asyncio.Future[Any], at_least: int, timeout: float = 60
) -> tuple[str, int]:
    """Once an engine server holds ``at_least`` of the step's rollouts: which one
    (the one holding most) and how many. Sent to held engine servers (``hold``),
    they can only pile up there; TimeoutError if they do not.

    Why held: looking at running engine servers for the moment to kill one, from
    this loop, missed the whole batch on a starved machine (32 rollouts of 16
    tokens ended between two looks), and the kill then held none of them."""
    deadline = time.monotonic() + timeout
    async with engine_stubs(addresses) as stubs:
        count, address = 0, ""
        while not rollouts.done():
            loads = await asyncio.gather(
                *(s.GetLoad(pb.GetLoadRequest(), timeout=5) for s in stubs),
                return_exceptions=True,
            )
            count, address = max(
                (
                    (x.registered_requests, a)
                    for a, x in zip(addresses, loads, strict=True)
                    if isinstance(x, pb.GetLoadResponse)
                ),
                default=(0, ""),
            )
            if count >= at_least:
                return address, count
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no held engine server took {at_least} of the step's rollouts within "
                    f"{timeout:g}s (most: {count}, on {address or 'none'})"
                )
            await asyncio.sleep(0.01)
    await rollouts  # what ended them
    raise RuntimeError(f"the step's rollouts ended on held engine servers ({count} seen held)")


async def wait_registered(
    stack: Stack, done: Callable[[int], bool], timeout: float, what: str
) -> float:
    """Until ``done(workers in discovery)`` holds; when it did (``time.monotonic``)."""
    started = time.monotonic()
    while not done(await asyncio.to_thread(stack.registered_workers)):
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        if stack.frontend is not None:
            stack.frontend.check_alive()
        await asyncio.sleep(0.02)
    return time.monotonic()


class Workers(Protocol):
    """What the training loop needs of its generation workers."""

    stack: Stack
    restarts: int

    @property
    def addresses(self) -> list[str]:
        """The engine servers serving now (the trainer refits these)."""

    @property
    def description(self) -> str: ...

    async def start(self) -> None: ...

    def instance_names(self) -> dict[str, str]:
        """Engine server instance ids (a restart makes a new one) to worker names."""

    async def close(self) -> None: ...


class ProcessStack:
    """Frontend, bridge and a paused-at-start vLLM engine server on a fixed address."""

    description = "1 worker (engine server and bridge processes)"

    def __init__(self, root: Path, group: ProcessGroup, model_dir: Path) -> None:
        self.stack = Stack.new(root, group, model_dir, MODEL, bridge_blocks=())
        self.listen = f"127.0.0.1:{free_port()}"
        self.engine: Proc | None = None
        self.restarts = 0

    @property
    def addresses(self) -> list[str]:
        return [self.listen]

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        self.start_engine()
        self.stack.start_bridge("bridge", self.listen, "--log-level", "warning")
        self.stack.start_frontend()
        self.stack.wait_serving(timeout=START_TIMEOUT_S)

    def start_engine(self) -> None:
        name = f"engine-{self.restarts}"
        self.engine, _ = self.stack.start_engine(
            name, *ENGINE_ARGS, backend="vllm", listen=self.listen, timeout=START_TIMEOUT_S
        )

    def kill(self) -> None:
        """SIGKILL the engine server: a syscall, made on the caller's thread at once."""
        assert self.engine is not None
        self.engine.signal(signal.SIGKILL)

    def restart(self) -> None:
        """Once the killed engine server is gone, a new one on its address (blocks)."""
        assert self.engine is not None
        self.engine.wait_exit(30)
        self.restarts += 1
        self.start_engine()

    def instance_names(self) -> dict[str, str]:
        try:
            return {instance_id(self.listen): f"engine-{self.restarts}"}
        except grpc.RpcError:
            return {}

    async def close(self) -> None:
        pass  # the process group stops them


@dataclass
class Worker:
    """One generation worker of the fleet: its actor and its engine server."""

    name: str
    actor: Any
    address: str
    instance_id: str
    pid: int


class RayFleet:
    """``size`` DynamoEngineActor workers (vLLM on this machine's CPUs)
    behind a KV-routed frontend, on a local Ray cluster this object starts (or the
    one this process already joined)."""

    def __init__(self, root: Path, group: ProcessGroup, model_dir: Path, size: int) -> None:
        if size < 1:
            raise ValueError(f"a fleet of {size} workers")
        self.stack = Stack.new(root, group, model_dir, MODEL, bridge_blocks=())
        self.model_dir = model_dir
        self.size = size
        self.workers: list[Worker] = []
        self.restarts = 0
        self._started = 0
        self._own_ray = False
        self._sigterm: Any = None
        self._cpus_per_worker = 1.0

    @property
    def description(self) -> str:
        return f"{self.size} workers in Ray actors, KV router"

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's cluster
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
        else:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            self._sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it
            cpus = float(os.cpu_count() or 1)
            ray.init(
                address="local",  # a cluster of its own, whatever RAY_ADDRESS says
                num_cpus=int(cpus),
                num_gpus=0,
                include_dashboard=False,
                object_store_memory=100 << 20,
                log_to_driver=False,  # the actors' logs stay in Ray's session folder
                logging_level=logging.WARNING,
            )
            self._own_ray = True
        # The fleet fits at once, and a replacement in the place of a killed worker.
        self._cpus_per_worker = min(1.0, cpus / self.size)

    def _new_actor(self) -> Any:
        from engine_server.ray_worker import DynamoEngineActor

        return DynamoEngineActor.options(num_cpus=self._cpus_per_worker).remote(
            model_path=str(self.model_dir),
            engine_args=("--backend", "vllm", *ENGINE_ARGS),
            served_model_name=MODEL,
            namespace=self.stack.namespace,
            # Killed (ray.kill), the actor takes its engine server along; its bridge
            # follows its parent (SIGTERM). The harness's environment sets Dynamo's
            # shutdown grace to 0 for quick tests, with which the bridge would cancel
            # the rollouts in flight at once (HTTP 499, which no driver retries).
            # Given a grace period (Dynamo's default: 5 s) they fail first as the
            # engine's loss: retryable (503), or migrated.
            engine_env=self.stack.bridge_env(DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="2"),
            bridge_args=("--log-level", "warning"),
            exit_after_engine_gone_s=5.0,
        )

    async def start_worker(self) -> Worker:
        """A new worker: its actor started, its engine server up (paused). Not in
        ``workers`` yet: ``add`` it."""
        name = f"worker-{self._started}"
        self._started += 1
        actor = self._new_actor()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                status = await actor.start.remote()
        except BaseException:
            import ray

            ray.kill(actor)
            raise
        if not status.serving or status.address is None:
            raise RuntimeError(f"{name} does not serve: {status.reason}")
        address = status.address
        instance = await asyncio.to_thread(instance_id, address)
        return Worker(name, actor, address, instance, status.pid)

    def add(self, worker: Worker) -> None:
        self.workers.append(worker)

    def instance_names(self) -> dict[str, str]:
        return {w.instance_id: w.name for w in self.workers}

    async def start(self) -> None:
        self._init_ray()
        await asyncio.to_thread(self.stack.start_frontend, *KV_ROUTER_ARGS)
        workers = await asyncio.gather(*(self.start_worker() for _ in range(self.size)))
        for worker in workers:
            self.add(worker)
        await asyncio.to_thread(self.stack.wait_serving, self.size, START_TIMEOUT_S)

    def kill(self, address: str) -> Worker:
        """``ray.kill`` the worker serving on ``address``; it leaves the fleet."""
        import ray

        worker = next(w for w in self.workers if w.address == address)
        ray.kill(worker.actor, no_restart=True)
        self.workers.remove(worker)
        self.restarts += 1
        if address.startswith("unix:"):  # its private socket folder outlives it
            with contextlib.suppress(OSError):
                shutil.rmtree(Path(address.removeprefix("unix:")).parent)
        return worker

    async def close(self) -> None:
        import ray

        workers, self.workers = self.workers, []

        async def stop(worker: Worker) -> None:
            # Bridge first (it leaves discovery), then the engine; then the actor ends.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(60):
                    await worker.actor.stop.remote(exit_actor=True)
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)

        await asyncio.gather(*(stop(w) for w in workers))
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
