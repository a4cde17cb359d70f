"""One call puts a host process's own engine behind Dynamo.

An RL generation worker (a Ray actor owning a vLLM ``AsyncLLM`` on its running
loop) calls ``start_dynamo_endpoint(engine, model_path=..., ...)`` and its
engine serves through Dynamo:

- the engine server runs on the host's loop, on a unix socket in a private
  directory (or where ``config.listen`` says; the directory is made anyway, for
  the bridge's note of its leases);
- a bridge (``python -m bridge``, its command line written from
  ``launch.bridge_command.BridgeLaunch``) runs as a child process with
  ``engine_env`` in its environment, supervised (``launch.supervisor``): its
  log lines reach the host's logging (logger ``engine_server.host.bridge``,
  levels kept), and a bridge that dies is restarted with backoff and jitter,
  the restarts counted, its etcd leases revoked first (``launch.leases``);
- the host's SIGTERM handler keeps working (chained, never replaced): on
  SIGTERM the bridge is told to leave at once, then the host's handler runs;
- when the host dies, even by SIGKILL, the bridge follows (the parent-death
  signal it arms itself, and a watcher: ``launch.parent_death``), so the model
  leaves Dynamo's discovery within seconds;
- ``stop()`` stops the bridge, then drains the engine server; the host's engine
  keeps running.

Only the leader of a tensor- or pipeline-parallel group serves: elsewhere the
call returns a handle that says so and does nothing.

The engine server never imports Dynamo: the bridge is another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Generator, Mapping, Sequence
from types import FrameType
from typing import Any, TypedDict

from engine_server.backends.base import EngineBackend
from engine_server.config import ServerConfig
from engine_server.server import EngineServerHandle, serve
from launch.bridge_command import BridgeLaunch, bridge_argv
from launch.leases import LeasesFile
from launch.parent_death import with_parent_pid
from launch.private_dir import PrivateDir
from launch.supervisor import ChildProcess, IntoLogging, RestartPolicy

log = logging.getLogger(__name__)
bridge_log = logging.getLogger("engine_server.host.bridge")

# How long a stopped bridge may take to leave (its requests end) before it is killed.
BRIDGE_STOP_TIMEOUT_S = 30.0


class DynamoEndpoint:
    """What ``start_dynamo_endpoint`` returns: ``await`` it to wait until it is
    stopped, ``stop()`` to stop the bridge and the engine server."""

    def __init__(
        self,
        server: EngineServerHandle | None = None,
        bridge: ChildProcess | None = None,
        private_dir: PrivateDir | None = None,
        reason: str = "",
    ) -> None:
        self.server = server
        self.bridge = bridge
        self._private_dir = private_dir
        # Why nothing is served here (not the group's leader), if so.
        self.reason = reason
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        if server is None:
            self._stopped.set()

    @property
    def serving(self) -> bool:
        return self.server is not None and not self._stopped.is_set()

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    @property
    def restarts(self) -> int:
        return self.bridge.restarts if self.bridge is not None else 0

    def done(self) -> bool:
        return self._stopped.is_set()

    async def wait(self) -> None:
        await self._stopped.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def stop(self, grace_period_s: float | None = None) -> None:
        """Bridge first (it leaves discovery, its requests finish), then the engine
        server (drained); the host's engine keeps running. Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_period_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_period_s: float | None) -> None:
        if self.bridge is not None:
            await self.bridge.stop(BRIDGE_STOP_TIMEOUT_S)
        if self.server is not None:
            await self.server.stop(grace_period_s)
        if self._private_dir is not None:
            await self._private_dir.remove_async()
        self._stopped.set()


def _chain_sigterm(endpoint: DynamoEndpoint, loop: asyncio.AbstractEventLoop) -> None:
    """Run ahead of the host's SIGTERM handling, never instead of it: the bridge
    leaves discovery at once, then whatever the host installed runs (a Python
    handler is called; an asyncio handler still gets the signal through its
    wakeup fd; the default action, termination, is taken)."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: SIGTERM not chained (stop() the endpoint yourself)")
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if endpoint.bridge is not None:
            endpoint.bridge.terminate()
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(endpoint.stop()))
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _backend_for(engine: Any) -> EngineBackend:
    if isinstance(engine, EngineBackend):
        return engine
    if "vllm" in sys.modules:  # a host holding an AsyncLLM has imported vLLM
        from vllm.v1.engine.async_llm import AsyncLLM

        if isinstance(engine, AsyncLLM):
            from engine_server.backends.vllm import VllmBackend

            return VllmBackend.from_engine(engine)
    raise TypeError(
        f"engine must be a vLLM AsyncLLM or an EngineBackend, got {type(engine).__name__}"
    )


class EndpointOptions(TypedDict, total=False):
    """How a host serves its engine: the keywords of ``start_dynamo_endpoint`` that a
    worker class (``DynamoEngineWorker``) takes when it is made and passes on when it
    starts; their defaults are ``start_dynamo_endpoint``'s."""

    served_model_name: str | None
    namespace: str
    engine_env: Mapping[str, str] | None
    bridge_args: Sequence[str]
    worker_idx: int
    leader_worker_idx: int
    exit_after_engine_gone_s: float


async def start_dynamo_endpoint(
    engine: Any,
    *,
    model_path: str | os.PathLike[str],
    served_model_name: str | None = None,
    namespace: str = "dynamo",
    engine_env: Mapping[str, str] | None = None,
    bridge_args: Sequence[str] = (),
    worker_idx: int = 0,
    leader_worker_idx: int = 0,
    config: ServerConfig | None = None,
    restart: RestartPolicy | None = None,
    exit_after_engine_gone_s: float = 10.0,
    chain_sigterm: bool = True,
) -> DynamoEndpoint:
    """Serve ``engine`` (a vLLM ``AsyncLLM`` the host owns, or an ``EngineBackend``)
    through Dynamo; see the module docs. Call it on the host's running loop.

    ``model_path``: the folder the frontend reads the tokenizer and config from.
    ``engine_env``: environment for the Dynamo side (``DYN_*``, ``NATS_SERVER``,
    ``ETCD_ENDPOINTS``...), over the host's own. ``bridge_args``: more
    ``python -m bridge`` flags. ``worker_idx``/``leader_worker_idx``: only the
    leader serves. ``exit_after_engine_gone_s``: how long the bridge waits for a
    vanished engine server before it leaves (its host is then gone too).
    """
    if worker_idx != leader_worker_idx:
        reason = f"worker {worker_idx} is not the leader ({leader_worker_idx}): not served here"
        log.info("%s", reason)
        return DynamoEndpoint(reason=reason)
    backend = _backend_for(engine)
    # The engine server's socket (unless ``config`` says where it listens), and
    # where the bridge notes its etcd leases, revoked when it exits.
    private_dir = PrivateDir()
    if config is None:
        config = ServerConfig(listen=private_dir.address)
    try:
        # Our wrapper around the host's AsyncLLM stops its relays and leaves the
        # engine; a backend the host gave us is the host's to stop.
        server = await serve(backend, config, shutdown_backend=backend is not engine)
    except BaseException:
        private_dir.remove()
        raise
    info = server.core.info
    name = served_model_name or (info.model_name if info is not None else None)
    launch = BridgeLaunch(
        engine_address=server.address,
        model_path=os.fspath(model_path),
        served_model_name=name or None,
        namespace=namespace,
        exit_after_engine_gone_s=exit_after_engine_gone_s or None,
    )
    leases = LeasesFile(private_dir.path)
    bridge = ChildProcess(
        "bridge",
        bridge_argv(sys.executable, launch, bridge_args),
        # The host has threads: the bridge arms its parent-death signal itself.
        with_parent_pid({**os.environ, **(engine_env or {}), **leases.env()}),
        output=IntoLogging(bridge_log),
        restart=restart,
        logger=log,
        after_exit=leases.revoke,
    )
    endpoint = DynamoEndpoint(server, bridge, private_dir)
    bridge.start()
    try:
        await bridge.wait_started()
    except BaseException:
        await endpoint.stop(grace_period_s=0)
        raise
    if chain_sigterm:
        _chain_sigterm(endpoint, asyncio.get_running_loop())
    log.info(
        "engine served on %s; bridge pid %s registers %r in namespace %r",
        server.address,
        bridge.pid,
        name,
        namespace,
    )
    return endpoint
