"""The engine server's lifecycle: bind, serve while the engine starts, drain, stop.

``start_server`` / ``serve`` run on the caller's event loop and return a handle,
so a host process that already owns an engine (an RL worker) can serve it
without giving up its loop; the CLI is a thin wrapper around the same calls.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_server.addresses import parse_listen_address
from engine_server.backends.base import EngineBackend, EngineDeadError, EngineInfo
from engine_server.config import ServerConfig
from engine_server.core import ServerCore
from engine_server.handlers import add_engine_servicer
from engine_server.kv_events import KvEventHub
from engine_server.metrics import ABORT_DRAIN, MetricsEndpoint
from engine_server.registry import RequestRegistry
from engine_server.servicer import EngineServicer

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICES = ("", engine_contract.SERVICE_NAME)


def grpc_server_options(config: ServerConfig) -> list[tuple[str, int]]:
    limit = config.limits.max_message_bytes
    return [
        # Bounded both ways: an oversized request gets RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # A unary Rollout sends nothing while the engine decodes; clients ping
        # to keep the connection alive, and gRPC's defaults would answer pings
        # that come more often than every 5 minutes with GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Our own pings find clients that vanished without closing the socket,
        # so their calls are cancelled and their engine requests aborted.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Two servers must never share a port silently.
        ("grpc.so_reuseport", 0),
    ]


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    tls = config.tls
    if tls is None:
        return None
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


@dataclass
class EngineServerHandle:
    """A running engine server. ``stop()`` drains and shuts the engine down."""

    address: str
    core: ServerCore
    _server: grpc.aio.Server
    _health: HealthServicer
    _servicer: EngineServicer
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _ready: asyncio.Future[EngineInfo] = field(default_factory=asyncio.Future)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: asyncio.Task[None] | None = None
    # False for a backend its host owns: stop() leaves it running.
    shutdown_backend: bool = True
    # The Prometheus endpoint (ServerConfig.metrics_port), if on.
    metrics: MetricsEndpoint | None = None

    @property
    def instance_id(self) -> str:
        return self.core.instance_id

    @property
    def config(self) -> ServerConfig:
        return self.core.config

    @property
    def registry(self) -> RequestRegistry:
        return self.core.registry

    @property
    def kv_hub(self) -> KvEventHub:
        return self.core.hub

    @property
    def backend(self) -> EngineBackend:
        return self.core.backend

    async def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Wait for the engine; raises what made its start fail."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def request_stop(self, grace_period_s: float | None = None) -> asyncio.Task[None]:
        """Begin stopping (see ``stop``) without waiting; for signal handlers."""
        if self._stopping is None:
            grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
            self._stopping = asyncio.create_task(self._stop(grace), name="engine-server-stop")
        return self._stopping

    async def stop(self, grace_period_s: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new requests, let those in flight finish for
        up to the grace period, abort the rest, then stop the engine. Idempotent."""
        await asyncio.shield(self.request_stop(grace_period_s))

    async def _stop(self, grace: float) -> None:
        core = self.core
        registry = core.registry
        log.info("[shutdown] draining: %d requests in flight, grace %.1fs", len(registry), grace)
        core.draining = True
        await _set_health(self._health, NOT_SERVING)
        if not await registry.wait_idle(grace):
            count = await registry.abort_all(shutdown=True)
            ABORT_DRAIN.inc(count)
            log.warning("[shutdown] grace period over: aborted %d requests", count)
            if not await registry.wait_idle(max(grace, 5.0)):
                log.error("[shutdown] %d requests did not end after abort", len(registry))
        core.hub.close()
        self._servicer.close_streams()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.stop(grace=1.0)
        if self.shutdown_backend:
            try:
                await core.backend.shutdown()
            except Exception:
                log.exception("[shutdown] engine shutdown failed")
        if self.metrics is not None:
            await self.metrics.close()
        if not self._ready.done():
            self._ready.set_exception(RuntimeError("server stopped before the engine was ready"))
        self._stopped.set()
        log.info("[shutdown] stopped")


async def _set_health(health: HealthServicer, status: int) -> None:
    for service in HEALTH_SERVICES:
        await health.set(service, status)


async def start_server(backend: EngineBackend, config: ServerConfig) -> EngineServerHandle:
    """Bind and start serving now (health NOT_SERVING); the engine starts in the
    background and the handle's ``wait_ready()`` reports when it is up."""
    listen = parse_listen_address(config.listen)  # ServerConfig checked it already
    core = ServerCore(backend, config, uuid.uuid4().hex)
    health = HealthServicer()
    server = grpc.aio.server(options=grpc_server_options(config))
    servicer = EngineServicer(core)
    add_engine_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["EngineService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    credentials = _server_credentials(config)
    target = listen.grpc_target()
    try:
        port = (
            server.add_secure_port(target, credentials)
            if credentials is not None
            else server.add_insecure_port(target)
        )
    except RuntimeError as e:
        raise OSError(f"cannot listen on {config.listen!r}: {e}") from e
    if port == 0 and not listen.is_unix:
        raise OSError(f"cannot listen on {config.listen!r}: address in use or unavailable")
    address = listen.grpc_target(port if not listen.is_unix else None)
    await _set_health(health, NOT_SERVING)
    await server.start()
    handle = EngineServerHandle(
        address=address, core=core, _server=server, _health=health, _servicer=servicer
    )
    if config.metrics_port is not None:
        host = "127.0.0.1" if listen.host is None else listen.host
        handle.metrics = MetricsEndpoint(core, host, config.metrics_port)
        try:
            await handle.metrics.start()
        except OSError:
            await server.stop(grace=0)
            raise
    log.info("engine server listening on %s (instance %s)", address, core.instance_id)
    handle._tasks.append(asyncio.create_task(_start_engine(handle), name="engine-start"))
    return handle


async def _start_engine(handle: EngineServerHandle) -> None:
    core = handle.core
    try:
        info = await core.start_engine()
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        log.exception("engine failed to start")
        if not handle._ready.done():
            handle._ready.set_exception(e)
        return
    if core.draining:
        return
    if handle.config.start_paused:
        await core.refit.pause(
            pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT, clear_cache=False)
        )
        log.info("generation paused until a ResumeGeneration (--start-paused)")
    await _set_health(handle._health, SERVING)
    core.refit.on_state_change = lambda: _follow_refit(handle)
    log.info(
        "engine ready: %s (%s %s), context %d, block size %d, %d blocks",
        info.model_name,
        info.backend_name,
        info.backend_version,
        info.context_length,
        info.kv_block_size,
        info.total_kv_blocks,
    )
    if not handle._ready.done():
        handle._ready.set_result(info)
    handle._tasks.append(asyncio.create_task(_watch_engine(handle), name="engine-health"))


def _follow_refit(handle: EngineServerHandle) -> None:
    """Health says NOT_SERVING while the engine sleeps (its memory is freed) or
    after an update broke its weights, so that bridges take the worker out of
    the router's pool meanwhile."""
    core = handle.core
    if core.draining or core.engine_dead is not None:
        return
    down = core.refit.sleeping or core.refit.broken is not None
    status = NOT_SERVING if down else SERVING
    handle._tasks[:] = [task for task in handle._tasks if not task.done()]
    handle._tasks.append(asyncio.create_task(_set_health(handle._health, status)))


async def _watch_engine(handle: EngineServerHandle) -> None:
    """Poll the engine's health; NOT_SERVING and UNAVAILABLE once it is dead."""
    interval = handle.config.health_poll_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            await handle.backend.check_health()
        except EngineDeadError as e:
            log.error("engine is dead: %s", e)
            handle.core.engine_dead = str(e) or "engine died"
            await _set_health(handle._health, NOT_SERVING)
            return


async def serve(
    backend: EngineBackend, config: ServerConfig | None = None, *, shutdown_backend: bool = True
) -> EngineServerHandle:
    """Serve ``backend`` on the running loop; return once the engine is ready.
    ``shutdown_backend=False``: ``stop()`` leaves the backend running (its host's)."""
    handle = await start_server(backend, config or ServerConfig())
    handle.shutdown_backend = shutdown_backend
    try:
        await handle.wait_ready()
    except BaseException:
        await handle.stop(grace_period_s=0)
        raise
    return handle
