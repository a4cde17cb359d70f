"""Engine servers, bridges and Dynamo frontends started together: the whole path
on loopback, with file discovery under one folder.

    with stack_under(root, model_dir, "tiny") as stack:
        _, address = stack.start_engine("engine", "--decode-step-ms", "2")
        stack.start_bridge("bridge", address)
        stack.start_frontend()
        stack.wait_serving()
        ... stack.base_url ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.cluster import Etcd, Nats, cluster_env
from harness.env import blocking_env, dynamo_env
from harness.http import routed_to, wait_for_model
from harness.procs import Proc, ProcessGroup, Role
from harness.waits import wait_until

# A frontend routing by KV overlap alone (no randomness in its choice).
KV_ROUTER_ARGS = ("--router-mode", "kv", "--router-temperature", "0")


@dataclass(frozen=True)
class Engine:
    """An engine server of the stack and the model name it serves."""

    proc: Proc
    address: str
    model: str


@dataclass
class Stack:
    """``model`` and ``namespace`` are the defaults of every ``start_*`` call; a stack
    may serve several models, each on its own engine servers and bridges."""

    root: Path
    group: ProcessGroup
    model_dir: Path
    model: str
    namespace: str
    env: dict[str, str]
    # What bridges cannot import: the dependency rule, enforced at runtime.
    bridge_blocks: tuple[str, ...] = ("vllm", "torch")
    engines: list[Engine] = field(default_factory=list)
    bridges: list[Proc] = field(default_factory=list)
    frontend: Proc | None = None
    base_url: str = ""
    # Cluster mode: workers register in this etcd instead of files under ``kv_dir``.
    etcd: Etcd | None = None

    @classmethod
    def new(
        cls,
        root: Path,
        group: ProcessGroup,
        model_dir: Path,
        model: str,
        namespace: str | None = None,
        bridge_blocks: tuple[str, ...] = ("vllm", "torch"),
        etcd: Etcd | None = None,
        nats: Nats | None = None,
        lease_ttl_s: int | None = None,
    ) -> Stack:
        """A stack of ``model_dir`` served as ``model``; nothing started yet. The
        namespace defaults to ``ns`` and the model name's letters and digits (file
        discovery percent-encodes the rest in its file names). With ``etcd`` (and
        ``nats``): Dynamo's cluster mode (``harness.cluster.cluster_env``)."""
        namespace = namespace or "ns" + "".join(c for c in model if c.isalnum())
        env = dynamo_env(root / "kv")
        if etcd is not None:
            del env["DYN_FILE_KV"]
            env |= cluster_env(etcd, nats, lease_ttl_s)
        stack = cls(root, group, model_dir, model, namespace, env, bridge_blocks)
        stack.etcd = etcd
        return stack

    @property
    def kv_dir(self) -> Path:
        return self.root / "kv"

    @property
    def procs(self) -> list[Proc]:
        front = [self.frontend] if self.frontend else []
        return [e.proc for e in self.engines] + self.bridges + front

    def address(self, model: str | None = None) -> str:
        """The first engine server serving ``model`` (the stack's by default)."""
        model = model or self.model
        return next(e.address for e in self.engines if e.model == model)

    def engine_stub(
        self, model: str | None = None
    ) -> tuple[grpc.Channel, pb_grpc.EngineServiceStub]:
        channel = grpc.insecure_channel(self.address(model))
        return channel, pb_grpc.EngineServiceStub(channel)

    def bridge_env(self, **extra: str) -> dict[str, str]:
        blocked = blocking_env(*self.bridge_blocks) if self.bridge_blocks else {}
        return {**self.env, **blocked, **extra}

    def start_engine(
        self,
        name: str,
        *args: str,
        model: str | None = None,
        backend: str = "sim",
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        launcher: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> tuple[Proc, str]:
        """An engine server of the stack's model folder serving ``model``; returns
        once it has its address."""
        model = model or self.model
        proc, address = self.group.engine_server(
            name,
            "--model",
            str(self.model_dir),
            "--served-model-name",
            model,
            *args,
            backend=backend,
            listen=listen,
            env=env,
            launcher=launcher,
            timeout=timeout,
        )
        self.engines.append(Engine(proc, address, model))
        return proc, address

    def start_bridge(
        self,
        name: str,
        address: str,
        *args: str,
        model: str | None = None,
        namespace: str | None = None,
        launcher: Sequence[str] = (),
        **env: str,
    ) -> Proc:
        """A bridge in front of ``address``, registering ``model`` in ``namespace``;
        ``env``: more environment variables (DYN_*)."""
        bridge = self.group.bridge(
            name,
            address,
            self.model_dir,
            model or self.model,
            namespace or self.namespace,
            self.bridge_env(**env),
            *args,
            launcher=launcher,
        )
        self.bridges.append(bridge)
        return bridge

    def start_workers(self, count: int, *args: str) -> list[str]:
        """``count`` engine servers (``engine-I``, with ``ARGS --seed I``), each behind
        its own bridge (``bridge-I``); returns their addresses."""
        addresses = []
        for i in range(count):
            _, address = self.start_engine(f"engine-{i}", *args, "--seed", str(i))
            self.start_bridge(f"bridge-{i}", address)
            addresses.append(address)
        return addresses

    def start_frontend(
        self, *args: str, port: int | None = None, env: Mapping[str, str] | None = None
    ) -> Proc:
        """A Dynamo frontend (``frontend-N``, the Nth started); its URL is ``base_url``.
        ``env``: more environment variables (``DYN_*``), for the frontend alone."""
        started = len(self.group.with_role(Role.FRONTEND))
        self.frontend, self.base_url = self.group.frontend(
            f"frontend-{started}", {**self.env, **(env or {})}, *args, port=port
        )
        return self.frontend

    def wait_models(self, models: Sequence[str], timeout: float = 90.0) -> None:
        """Until the frontend lists every one of ``models``."""
        procs = [p for p in self.procs if p.alive()]
        for model in models:
            wait_for_model(self.base_url, model, procs, timeout)

    def wait_serving(self, workers: int = 1, timeout: float = 90.0) -> None:
        """Until ``workers`` workers registered in the stack's namespace and the
        frontend lists its model."""
        procs = [p for p in self.procs if p.alive()]
        wait_until(
            lambda: self.registered_workers() >= workers,
            timeout,
            f"{workers} workers registered",
            procs,
        )
        wait_for_model(self.base_url, self.model, procs, timeout)

    def wait_routed(self, workers: int, timeout: float = 30.0) -> None:
        """Until the frontend's router has sent a short completion to each of
        ``workers`` workers. Registered is not yet routed to: the frontend learns of
        each instance from its own discovery watch, a moment later (a frontend
        choosing round-robin or at random; a KV router may keep to one)."""
        procs = [p for p in self.procs if p.alive()]
        reached: set[int] = set()

        def all_reached() -> bool:
            prompt = [5, 6, 7 + len(reached)]
            reached.add(int(routed_to(self.base_url, self.model, prompt)["decode_worker_id"]))
            return len(reached) >= workers

        wait_until(all_reached, timeout, f"the frontend routing to {workers} workers", procs)

    def registered_workers(self, namespace: str | None = None) -> int:
        """Worker instances registered for ``namespace``'s generate endpoint now."""
        namespace = namespace or self.namespace
        if self.etcd is None:
            return registered_workers(self.kv_dir, namespace)
        return len(self.etcd.keys(f"v1/instances/{namespace}/backend/generate/"))


def registered_workers(kv_dir: Path, namespace: str) -> int:
    """Worker instances registered for ``namespace``'s generate endpoint (file discovery)."""
    instances = kv_dir / "v1" / "instances"
    if not instances.is_dir():
        return 0
    prefix = f"{namespace}%2F"
    return sum(
        1
        for p in instances.rglob("*")
        if p.is_file() and p.name.startswith(prefix) and "%2Fgenerate%2F" in p.name
    )


@contextmanager
def stack_under(
    root: Path, model_dir: Path, model: str, namespace: str | None = None
) -> Iterator[Stack]:
    """``Stack.new`` under ``root``, in a process group of its own (logs in
    ``root/logs``): whatever the stack started is stopped on exit."""
    with ProcessGroup(root / "logs") as group:
        yield Stack.new(root, group, model_dir, model, namespace)


@contextmanager
def kv_routed_stack(
    root: Path, model_dir: Path, model: str, workers: int, *engine_args: str, namespace: str = ""
) -> Iterator[Stack]:
    """A serving stack under ``root``: ``workers`` sim engine servers (``engine_args``,
    seeds 0, 1, ...), each behind its own bridge, and a frontend routing by KV
    overlap (``KV_ROUTER_ARGS``)."""
    with stack_under(root, model_dir, model, namespace or None) as stack:
        stack.start_workers(workers, *engine_args)
        stack.start_frontend(*KV_ROUTER_ARGS)
        stack.wait_serving(workers=workers, timeout=60)
        yield stack
