"""A generation worker in a Ray actor, as RL frameworks host them, served through Dynamo.

NeMo RL, verl, OpenRLHF and SkyRL run their generation engines in Ray actors.
``DynamoEngineActor`` is such an actor: it owns its engine (a sim or any
backend from an engine-server command line, or a vLLM ``AsyncLLM`` built from
engine arguments) and, on the actor's own event loop, puts it behind Dynamo with
``engine_server.host.start_dynamo_endpoint`` (the bridge a supervised child)::

    worker = DynamoEngineActor.options(num_cpus=1).remote(
        model_path="/models/policy", served_model_name="policy", engine_env={...}
    )
    status = ray.get(worker.start.remote())
    ...
    ray.get(worker.stop.remote())  # or exit_actor=True to end the actor too

How it ends, whatever ends it:

- ``stop()``: the bridge leaves discovery, the engine server drains, the engine
  stops; the actor lives on (``exit_actor=True``: Ray's own exit follows).
- A graceful exit Ray runs (``exit_actor()``, ``__ray_terminate__``, the last
  handle gone, SIGTERM to the worker): Ray stops the actor's loop, then calls
  ``__ray_shutdown__``, which tells the bridge to leave and waits for it.
- ``ray.kill`` (the worker process ends at once): the bridge follows its dead
  parent (``launch.parent_death``: SIGTERM, Dynamo's orderly exit) and leaves discovery.

By default Ray SIGKILLs a worker's direct children as the worker exits, before
any hook of ours runs (``RAY_kill_child_processes_on_worker_exit``): a bridge
killed so stays in discovery until its lease runs out (file discovery: some
12 s, measured), and the frontend keeps routing to it. The actor class turns
that off for its own worker (``RAY_ENV``, in its ``runtime_env``); its children
end themselves instead (the bridge as above, vLLM's EngineCore through
``engine_server.vllm_plugin``). Whoever passes their own ``runtime_env`` in
``.options()`` must keep ``RAY_ENV`` in its ``env_vars`` (a warning says so).

The engine server never imports Dynamo; this module imports only Ray besides it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Unpack

import ray

from engine_server.backends.base import EngineBackend
from engine_server.config import ServerConfig
from engine_server.host import DynamoEndpoint, EndpointOptions, start_dynamo_endpoint
from engine_server.vllm_processes import before_engine_start, shut_down
from launch.private_dir import PrivateDir

log = logging.getLogger(__name__)

# The actor's worker keeps its children at exit: they leave discovery themselves.
RAY_ENV = {"RAY_kill_child_processes_on_worker_exit": "false"}


@dataclass(frozen=True)
class WorkerStatus:
    """What a worker says of itself (plain data: it crosses Ray's object store)."""

    serving: bool
    # Why nothing is served here (not the group's leader, stopped), if so.
    reason: str
    address: str | None
    model: str | None
    bridge_pid: int | None
    restarts: int
    weight_version: str | None
    pid: int


def _in_ray_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _children_kept() -> bool:
    return all(os.environ.get(k, "").lower() in ("0", "false") for k in RAY_ENV)


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, leaving it for its owner to reap."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already, or not ours
        return True


def _wait_exited(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class DynamoEngineWorker:
    """A generation worker owning its engine, served through Dynamo from its own loop.

    ``engine_args``: an engine-server command line (``--backend sim --decode-step-ms
    2``; ``--model model_path`` is added when absent), backend and server flags
    alike. ``vllm_engine_args``: instead, ``AsyncEngineArgs`` fields for a vLLM
    ``AsyncLLM`` this worker builds and owns (``model`` defaults to ``model_path``).
    Subclasses may override ``make_engine`` (as actors: ``ray.remote(runtime_env=
    {"env_vars": RAY_ENV})(Subclass)``). The other arguments are
    ``start_dynamo_endpoint``'s; ``bridge_exit_timeout_s`` bounds the wait for
    the bridge in ``__ray_shutdown__`` (then it is killed).

    Its methods are coroutines: Ray runs this class as an async actor, on one
    event loop that the engine, its server and the bridge's supervisor share.
    """

    def __init__(
        self,
        *,
        model_path: str,
        engine_args: Sequence[str] = ("--backend", "sim"),
        vllm_engine_args: Mapping[str, Any] | None = None,
        bridge_exit_timeout_s: float = 10.0,
        **endpoint: Unpack[EndpointOptions],
    ) -> None:
        self.model_path = model_path
        self.engine_args = list(engine_args)
        self.vllm_engine_args = dict(vllm_engine_args) if vllm_engine_args is not None else None
        self.bridge_exit_timeout_s = bridge_exit_timeout_s
        # Refused here, as a misspelt keyword always was, not at start().
        unknown = sorted(set(endpoint) - EndpointOptions.__optional_keys__)
        if unknown:
            raise TypeError(f"DynamoEngineWorker got unexpected keyword arguments {unknown}")
        self.endpoint_options: EndpointOptions = EndpointOptions(**endpoint)
        # The engine this worker owns: an EngineBackend or a vLLM AsyncLLM.
        self.engine: Any = None
        self.endpoint: DynamoEndpoint | None = None
        self._socket_dir: PrivateDir | None = None
        self._starting: asyncio.Task[None] | None = None

    def make_engine(self) -> tuple[Any, ServerConfig | None]:
        """The engine to own and the engine server's config (None: defaults on a
        private unix socket)."""
        if self.vllm_engine_args is not None:
            # vLLM's CPU-build defaults must be in the environment before vLLM loads.
            from engine_server.backends.vllm._env import apply_env_defaults

            apply_env_defaults()
            # Its EngineCore and sockets end when this process does (Ray no longer kills it).
            before_engine_start()
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            fields = {"model": self.model_path, **self.vllm_engine_args}
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**fields)), None
        from engine_server import cli

        argv = list(self.engine_args)
        if "--model" not in argv and not any(a.startswith("--model=") for a in argv):
            argv += ["--model", self.model_path]
        try:
            backend, config = cli.backend_and_config(cli.parse_args(argv))
        except SystemExit as e:  # argparse's way; it must not end the actor's worker
            why = "see stderr for argparse's message" if isinstance(e.code, int) else e.code
            raise ValueError(f"engine_args {argv}: {why}") from None
        if not any(a == "--listen" or a.startswith("--listen=") for a in argv):
            self._socket_dir = PrivateDir()
            config = replace(config, listen=self._socket_dir.address)
        return backend, config

    async def start(self) -> WorkerStatus:
        """Build the engine and serve it through Dynamo (the group's leader only);
        once: later calls wait for the first and report, or raise what it raised
        (``stop()`` then releases what it had built)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return await self.status()

    async def _start(self) -> None:
        if _in_ray_actor() and not _children_kept():
            log.warning(
                "Ray kills this worker's children as it exits: the bridge would stay in "
                "discovery until its lease ends; keep %s in the actor's runtime_env",
                RAY_ENV,
            )
        config = None
        options = self.endpoint_options
        # The others get a handle saying why not.
        if options.get("worker_idx", 0) == options.get("leader_worker_idx", 0):
            self.engine, config = self.make_engine()
        self.endpoint = await start_dynamo_endpoint(
            self.engine,
            model_path=self.model_path,
            config=config,
            **options,
            # Ray's workers run actors off the main thread and handle SIGTERM
            # themselves: __ray_shutdown__ is the hook.
            chain_sigterm=False,
        )

    async def status(self) -> WorkerStatus:
        endpoint = self.endpoint
        server = endpoint.server if endpoint is not None else None
        info = server.core.info if server is not None else None
        if endpoint is None:
            reason = "not started"
        elif endpoint.reason or endpoint.serving:
            reason = endpoint.reason
        else:
            reason = "stopped"
        return WorkerStatus(
            serving=endpoint is not None and endpoint.serving,
            reason=reason,
            address=endpoint.address if endpoint is not None else None,
            model=(
                self.endpoint_options.get("served_model_name")
                or (info.model_name if info is not None else None)
            ),
            bridge_pid=endpoint.bridge.pid if endpoint is not None and endpoint.bridge else None,
            restarts=endpoint.restarts if endpoint is not None else 0,
            weight_version=server.core.refit.version if server is not None else None,
            pid=os.getpid(),
        )

    async def address(self) -> str | None:
        """The engine server's address (the contract's refit RPCs go there)."""
        return self.endpoint.address if self.endpoint is not None else None

    async def weight_version(self) -> str | None:
        """The label of the weights serving now (set by the trainer's refits)."""
        server = self.endpoint.server if self.endpoint is not None else None
        return server.core.refit.version if server is not None else None

    async def stop(self, exit_actor: bool = False) -> None:
        """Bridge first (it leaves discovery), then the engine server (drained),
        then the engine. ``exit_actor``: then end the actor through Ray's own exit."""
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self.endpoint is not None:
            await self.endpoint.stop()
        engine, self.engine = self.engine, None
        if isinstance(engine, EngineBackend):
            await engine.shutdown()
        elif engine is not None:  # an AsyncLLM
            await shut_down(engine)
        if self._socket_dir is not None:
            await self._socket_dir.remove_async()
        if exit_actor:
            ray.actor.exit_actor()

    def __ray_shutdown__(self) -> None:
        """Ray's graceful exits call this on the worker's main thread, the actor's
        loop already stopped: the bridge leaves discovery now, and the worker
        exits only once it has (or the timeout has passed: then it is killed)."""
        bridge = self.endpoint.bridge if self.endpoint is not None else None
        if bridge is None:
            return
        process = bridge.process
        bridge.terminate()
        # None running: nothing to wait for (an exited one's pid may be reused).
        if process is None or process.returncode is not None:
            return
        if not _wait_exited(process.pid, self.bridge_exit_timeout_s):
            log.error(
                "bridge (pid %d) still running %.0fs after SIGTERM: killing it",
                process.pid,
                self.bridge_exit_timeout_s,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)


# The actor class: ``DynamoEngineActor.options(...).remote(model_path=..., ...)``.
DynamoEngineActor = ray.remote(runtime_env={"env_vars": RAY_ENV})(DynamoEngineWorker)
