"""BridgeEngine: a Dynamo LLMEngine that forwards every request to one engine server.

Thin glue: request mapping lives in ``codec``, transport in ``client``, error
mapping in ``errors``, KV events in ``kv_relay``/``kv_view``, the engine
server's liveness in ``engine_watch``, and the worker's place in discovery in
``registration``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from dynamo._core import Context
from dynamo.common.backend.engine import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.health_check import build_health_check_payload, is_probe
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.utils.token_ids import normalize_request_token_ids

import engine_contract
from bridge import codec, errors, metrics
from bridge.client import EngineClient, IncompatibleServerError, check_compatible
from bridge.config import BridgeConfig, parse_args
from bridge.engine_watch import EngineWatch
from bridge.generate_mux import PendingGenerate
from bridge.kv_relay import KvRelay
from bridge.kv_view import RouterView
from bridge.logging import configure_bridge_logging
from bridge.registration import EXIT_REGISTRATION_LOST, Registration
from bridge.rl_admin import RlAdmin
from bridge.rl_endpoint import RlEndpoint
from bridge.rollout_mux import PendingRollout
from bridge.rollout_text import RolloutText
from bridge.swap import unfollowable_changes
from bridge.system_server import SystemPort, SystemServer
from engine_contract.trace import trace_context
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


class _Call(Protocol):
    """A gRPC call object, or a rollout on the shared stream: both cancel alike."""

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


@dataclass
class _InFlight:
    """One engine request, so that abort() can find and stop it."""

    request_id: str
    call: _Call | None = None
    aborted: bool = False
    # Failed by the bridge itself: the engine server stopped answering.
    stalled: bool = False
    # Dynamo's request id (the engine request id unless a rollout names its own).
    context_id: str = ""
    # The request's W3C trace context (traceparent, tracestate), if Dynamo has one.
    trace: Mapping[str, str] | None = None


class BridgeEngine(LLMEngine):
    """Dynamo's side of one engine server: registers what the server reports, relays
    its KV events, and turns each Dynamo request into one Rollout or Generate call."""

    def __init__(self, config: BridgeConfig, system_port: SystemPort | None = None) -> None:
        self.config = config
        self._client: EngineClient | None = None
        self._relay: KvRelay | None = None
        self.info: pb.GetServerInfoResponse | None = None
        self.instance_id = ""
        # Keyed by Dynamo's context id.
        self._inflight: dict[str, _InFlight] = {}
        self._closed = False
        self._stream_rollouts = False
        self._stream_generates = False
        self._watch: EngineWatch | None = None
        self.registration = Registration(config.discovery_backend, on_lost=self._registration_lost)
        self._worker_id = 0
        # What the process exits with (bridge.__main__): non-zero when the bridge
        # gave up on its registration, so that a supervisor restarts it.
        self.exit_code = 0
        self.rl_admin = RlAdmin(lambda: self._client, self.registration, self._engine_request_id)
        self._system = (
            SystemServer(system_port, self.rl_admin.routes(), config.admin_token)
            if system_port is not None
            else None
        )
        self._rl_endpoint: RlEndpoint | None = None
        # Why the engine server now at our address cannot be served (registration
        # mismatch), if so: out of the pool until a fitting one is back.
        self.unservable: str | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        self._text = RolloutText(config.model_path)
        self._server_info = metrics.EngineServerCollector(
            lambda: (
                config.engine_address,
                self.instance_id,
                self.info.backend_name if self.info is not None else "",
            )
        )

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[BridgeEngine, WorkerConfig]:
        bridge_config, worker_config = parse_args(argv)
        configure_bridge_logging(bridge_config.log_level)
        # Before Dynamo's runtime starts: it must find its system port moved inside.
        system_port = SystemPort.claim() if bridge_config.rl_routes else None
        if bridge_config.admin_token is not None and system_port is None:
            log.warning(
                "an admin token is set (%s) but this bridge serves no admin routes "
                "(--no-rl-routes, or no DYN_SYSTEM_PORT): it protects nothing",
                bridge_config.admin_token.source,
            )
        return cls(bridge_config, system_port), worker_config

    # -- lifecycle ---------------------------------------------------------

    async def register_prometheus(self, metrics_handle: Any) -> None:
        """The bridge's own metrics (``bridge.metrics``) in the worker's /metrics."""
        from dynamo.common.backend.metrics import register_engine_registry

        register_engine_registry(metrics_handle, metrics.REGISTRY)

    async def start(self, worker_id: int) -> EngineConfig:
        cfg = self.config
        metrics.REGISTRY.register(self._server_info)
        if self._system is not None:
            await self._system.start()
        log.info(
            "worker %s: connecting to engine server at %s (waiting up to %.0fs)",
            worker_id,
            cfg.engine_address,
            cfg.connect_timeout_s,
        )
        self._worker_id = worker_id
        self._client = EngineClient(cfg.engine_address, cfg.client)
        info = await self._client.wait_ready(cfg.connect_timeout_s)
        self._watch = EngineWatch(
            self._client,
            self._engine_changed,
            interval_s=cfg.watch_interval_s,
            stall_timeout_s=cfg.stall_timeout_s,
            on_stalled=self._fail_stalled,
            gone_after_s=cfg.exit_after_engine_gone_s,
            on_gone=self._engine_gone,
        )
        self._watch.start()
        self.info, self.instance_id = info, info.instance_id
        self._registered = info  # what Dynamo is told; a replacement must fit it
        self._client.use_server_limits(info)
        self._stream_rollouts = self._choose_rollout_transport(info)
        self._stream_generates = self._choose_generate_transport(info)
        ec = info.engine_config
        log.info(
            "engine server %s ready: %s (%s %s, contract %d), context %d, block size %d, "
            "rollouts %s, completions %s",
            info.instance_id,
            info.model_name,
            info.backend_name,
            info.backend_version,
            info.contract_revision,
            ec.context_length,
            ec.kv_block_size,
            "multiplexed on a stream" if self._stream_rollouts else "one call each",
            self._generates_transport(),
        )
        log.info("registering endpoint types %s: %s", cfg.endpoint_types, cfg.endpoint_types_reason)
        return EngineConfig(
            model=cfg.model_path,
            served_model_name=cfg.served_model_name or info.model_name or None,
            llm=LlmRegistration(
                context_length=ec.context_length or None,
                kv_cache_block_size=ec.kv_block_size or None,
                total_kv_blocks=ec.total_kv_blocks or None,
                max_num_seqs=ec.max_running_sequences or None,
                max_num_batched_tokens=ec.max_batched_tokens or None,
                data_parallel_size=max(1, ec.data_parallel_size),
                data_parallel_start_rank=ec.data_parallel_start_rank,
            ),
        )

    def _generates_transport(self) -> str:
        """How completions travel, for the log."""
        if not self._stream_generates:
            return "one call each"
        client = self._client
        paced = client is not None and client.paced_generates
        return "multiplexed on a stream" + (", paced" if paced else "")

    def _choose_rollout_transport(self, info: pb.GetServerInfoResponse) -> bool:
        """True to stream rollouts; refuses a server too old for a required stream."""
        return self._choose_transport(
            info,
            self.config.rollout_transport,
            "--rollout-transport",
            "Rollouts",
            engine_contract.ROLLOUTS_STREAM_REVISION,
        )

    def _choose_generate_transport(self, info: pb.GetServerInfoResponse) -> bool:
        """True to multiplex completions; refuses a server too old for a required stream."""
        return self._choose_transport(
            info,
            self.config.generate_transport,
            "--generate-transport",
            "Generates",
            engine_contract.GENERATES_STREAM_REVISION,
        )

    def _choose_transport(
        self,
        info: pb.GetServerInfoResponse,
        transport: str,
        flag: str,
        stream: str,
        revision: int,
    ) -> bool:
        """``transport`` (``flag``: auto|stream|unary) against a server: True to use
        ``stream``, which servers serve from contract ``revision`` on."""
        serves_stream = info.contract_revision >= revision
        if transport == "stream" and not serves_stream:
            raise IncompatibleServerError(
                f"engine server at {self.config.engine_address} implements contract revision "
                f"{info.contract_revision}, without the {stream} stream (revision "
                f"{revision}) that {flag} stream needs: upgrade the engine server or use auto"
            )
        return transport == "stream" or (transport == "auto" and serves_stream)

    async def kv_event_sources(self) -> list[KvEventSource]:
        if self._client is None or self.info is None or not self.config.kv_events:
            return []
        block_size = self.info.engine_config.kv_block_size
        if block_size <= 0:
            return []
        ec = self.info.engine_config
        ranks = max(1, ec.data_parallel_size)
        view = RouterView(
            block_size,
            ranks=ranks,
            on_instance_change=self._set_instance,
            max_delay_ms=self.config.kv_max_delay_ms,
        )
        relay = self._relay = KvRelay(self._client, view)
        relay.start()
        # One source per rank: the router tells the ranks' caches apart.
        return [
            PushSource(
                on_ready=functools.partial(relay.on_ready, rank=r),
                dp_rank=ec.data_parallel_start_rank + r,
            )
            for r in range(ranks)
        ]

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        """The served endpoint: from now on the bridge keeps it in discovery as the
        engine's health says, and heals a registration discovery dropped."""
        self.registration.start(endpoint, self._worker_id)
        if self.config.enable_rl:
            system_url = self._system.address.url if self._system is not None else None
            self._rl_endpoint = RlEndpoint(self.config, self.rl_admin.routes(), system_url)
            self._rl_endpoint.start()

    async def _engine_changed(self, serving: bool, reason: str) -> None:
        if serving:
            metrics.RECONNECTS.inc()
            await self._refresh_info()  # maybe another instance: adapt, or stay out
            if self.unservable is None:
                await self.registration.rejoin(reason)
        else:
            await self.registration.leave(reason)

    async def _refresh_info(self) -> None:
        """Re-read the engine server's info; adapt to a new instance, or leave the
        pool (loudly) when Dynamo's registration cannot follow what changed."""
        async with self._refresh_lock:  # the watch and the KV relay may both ask
            await self._refresh()

    async def _refresh(self) -> None:
        client, old = self._client, self.info
        if client is None or old is None:
            return
        try:
            info = await client.server_info()
            check_compatible(info, client.address)
        except grpc.aio.AioRpcError:
            return  # not answering (yet): the watch will tell
        except IncompatibleServerError as e:
            await self._refuse(str(e))
            return
        if info.instance_id == old.instance_id and self.unservable is None:
            return
        changes = unfollowable_changes(
            self._registered,
            info,
            name_pinned=bool(self.config.served_model_name),
            kv_routing=self.config.kv_events,
        )
        if changes:
            await self._refuse(
                f"the engine server at {client.address} (instance {info.instance_id}) differs "
                f"from what this worker registered: {'; '.join(changes)}. Dynamo cannot follow "
                "that; restart the bridge to register it"
            )
            return
        was_unservable = self.unservable is not None
        self.unservable = None
        self.info, self.instance_id = info, info.instance_id
        metrics.INSTANCE_CHANGES.inc()
        client.use_server_limits(info)
        self._stream_rollouts = self._choose_rollout_transport(info)
        self._stream_generates = self._choose_generate_transport(info)
        log.info(
            "engine server replaced: instance %s -> %s (%s %s, contract %d, rollouts %s, "
            "completions %s)",
            old.instance_id,
            info.instance_id,
            info.backend_name,
            info.backend_version,
            info.contract_revision,
            "multiplexed on a stream" if self._stream_rollouts else "one call each",
            self._generates_transport(),
        )
        watch = self._watch
        if was_unservable and (watch is None or watch.serving):
            # Back in the pool now: a quick swap may never fail a health probe, so
            # the watch would not tell.
            await self.registration.rejoin(f"a fitting engine server is back at {client.address}")

    async def _refuse(self, why: str) -> None:
        if self.unservable != why:
            log.error("%s; out of the router's pool", why)
        self.unservable = why
        await self.registration.leave(why)

    def _fail_stalled(self) -> None:
        """The engine server has not answered for the stall timeout: fail what waits
        on it (retryable), so that nothing hangs until TCP keepalive gives up."""
        stuck = [e for e in self._inflight.values() if e.call is not None and not e.call.done()]
        for entry in stuck:
            entry.stalled = True
            if entry.call is not None:
                entry.call.cancel()
        log.error(
            "engine server at %s unresponsive for %.0fs: failed %d requests waiting on it "
            "(retryable)",
            self.config.engine_address,
            self.config.stall_timeout_s or 0,
            len(stuck),
        )

    def _engine_gone(self) -> None:
        log.error(
            "engine server at %s unreachable for %.0fs: exiting (--exit-after-engine-gone)",
            self.config.engine_address,
            self.config.exit_after_engine_gone_s or 0,
        )
        os.kill(os.getpid(), signal.SIGTERM)  # Dynamo's orderly shutdown: leave discovery

    def _registration_lost(self) -> None:
        self.exit_code = EXIT_REGISTRATION_LOST
        os.kill(os.getpid(), signal.SIGTERM)  # Dynamo's orderly shutdown, then exit 75

    async def health_check_payload(self) -> dict[str, Any] | None:
        """Dynamo's canary (on with ``DYN_HEALTH_CHECK_ENABLED``, shown on the
        ``DYN_SYSTEM_PORT`` /health): ``generate()`` answers it from the engine
        server's gRPC health, so /health turns notready while the engine is down."""
        eos = self.info.eos_token_ids[0] if self.info is not None and self.info.eos_token_ids else 0
        return build_health_check_payload(eos)

    async def cleanup(self) -> None:
        """Stop the KV stream, then close the channel; null-safe and idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(KeyError):
            metrics.REGISTRY.unregister(self._server_info)
        await self.registration.stop()
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        rl_endpoint, self._rl_endpoint = self._rl_endpoint, None
        if rl_endpoint is not None:
            await rl_endpoint.stop()
        system, self._system = self._system, None
        if system is not None:
            await system.stop()
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.stop()
        relay, self._relay = self._relay, None
        if relay is not None:
            await relay.stop()
        for entry in self._inflight.values():
            if entry.call is not None:
                entry.call.cancel()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        log.info("bridge cleaned up")

    def _set_instance(self, instance_id: str) -> None:
        """The KV stream shows another instance: re-read what it is (at once: a fast
        restart may never fail a health probe)."""
        if instance_id != self.instance_id:
            log.info("engine server restarted: instance %s -> %s", self.instance_id, instance_id)
            self.instance_id = instance_id
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self._refresh_info())

    # -- requests ----------------------------------------------------------

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        if is_probe(request):
            # No engine work (nor KV-cache churn) for a probe: the server's health says it.
            client = self._client
            if client is None or not await client.serving():
                raise errors.engine_not_serving(self.config.engine_address)
            yield {"token_ids": [], "index": 0, "finish_reason": "stop"}
            return
        normalize_request_token_ids(request)
        try:
            spec = codec.parse_request_kind(request.get("annotations"))  # type: ignore[arg-type]
        except codec.RequestError as e:
            raise errors.to_dynamo(e) from e
        client = self._client
        if client is None:
            raise errors.to_dynamo(grpc.aio.UsageError("the bridge is not started or closed"))
        watch = self._watch
        if self.unservable is not None or (watch is not None and not watch.serving):
            # Wedged or gone: fail now (migratable) rather than wait on it.
            raise errors.engine_not_serving(self.config.engine_address)
        context_id = context.id()
        request_id = (spec.request_id if spec is not None else None) or context_id
        trace = _trace_context(context)
        if log.isEnabledFor(logging.DEBUG):
            # The id on both sides of the hop, and the trace context.
            log.debug(
                "request %s: engine request %s, traceparent %s, %s",
                context_id,
                request_id,
                (trace or {}).get("traceparent", "-"),
                {k: v for k, v in request.items() if k != "token_ids"},
            )
        entry = _InFlight(request_id, context_id=context_id, trace=trace)
        self._inflight[context_id] = entry
        prompt_tokens = len(request.get("token_ids") or ())
        try:
            if context.is_stopped():
                yield codec.cancelled_chunk(prompt_tokens)
                return
            if spec is not None:
                chunks = self._rollout(client, entry, request, spec)
            else:
                chunks = self._generate(client, entry, request)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        finally:
            # Dynamo closes the stream early on a client disconnect or a stop string;
            # cancelling the call aborts the engine request at once.
            if entry.call is not None and not entry.call.done():
                entry.call.cancel()
                log.debug(
                    "request %s: stream closed early, engine call cancelled", entry.request_id
                )
            self._inflight.pop(context_id, None)

    async def _rollout(
        self,
        client: EngineClient,
        entry: _InFlight,
        request: GenerateRequest,
        spec: codec.RolloutSpec,
    ) -> AsyncGenerator[codec.Chunk, None]:
        try:
            message = codec.build_rollout_request(entry.request_id, request, spec)
            rank = self._routed_rank(request)
            if rank is not None:
                message.data_parallel_rank = rank
            streamed = self._stream_rollouts
            call: PendingRollout | grpc.aio.UnaryUnaryCall = (
                client.stream_rollout(message, entry.trace)
                if streamed
                else client.rollout(message, _trace_metadata(entry))
            )
            entry.call = call
            timeout = self.config.rollout_timeout_s
            started = time.perf_counter()
            try:
                async with asyncio.timeout(timeout):
                    response = await call
            except TimeoutError:
                call.cancel()
                raise errors.rollout_timed_out(timeout) from None
            metrics.HOPS["rollout", streamed].observe(started)
            if response.instance_id and response.instance_id != self.instance_id:
                self._set_instance(response.instance_id)  # swapped under us: re-read it
            text = self._text.decode(response.token_ids) if spec.text else ""
            chunk = codec.rollout_chunk(response, text)
        except asyncio.CancelledError:
            if entry.stalled:
                raise errors.engine_not_serving(self.config.engine_address) from None
            if not entry.aborted:
                raise
            yield codec.cancelled_chunk(len(request["token_ids"]))
            return
        except Exception as e:
            if entry.stalled and _is_cancelled(e):
                raise errors.engine_not_serving(self.config.engine_address) from e
            if entry.aborted and _is_cancelled(e):
                yield codec.cancelled_chunk(len(request["token_ids"]))
                return
            raise errors.to_dynamo(e) from e
        yield chunk

    async def _generate(
        self, client: EngineClient, entry: _InFlight, request: GenerateRequest
    ) -> AsyncGenerator[codec.Chunk, None]:
        prompt_tokens = len(request["token_ids"])
        generated = 0
        try:
            message = codec.build_generate_request(entry.request_id, request)
            rank = self._routed_rank(request)
            if rank is not None:
                message.data_parallel_rank = rank
            streamed = self._stream_generates
            call: PendingGenerate | grpc.aio.UnaryStreamCall = (
                client.stream_generate(message, entry.trace)
                if streamed
                else client.generate(message, _trace_metadata(entry))
            )
            entry.call = call
            started = time.perf_counter()
            async for response in call:
                chunk = codec.generate_chunk(response)
                generated += len(chunk["token_ids"])
                if "finish_reason" in chunk:
                    metrics.HOPS["completion", streamed].observe(started)
                    yield chunk
                    return
                yield chunk
        except asyncio.CancelledError:
            if entry.stalled:
                raise errors.engine_not_serving(self.config.engine_address) from None
            if not entry.aborted:
                raise
        except Exception as e:
            if entry.stalled and _is_cancelled(e):
                raise errors.engine_not_serving(self.config.engine_address) from e
            if not (entry.aborted and _is_cancelled(e)):
                raise errors.to_dynamo(e) from e
        if entry.aborted:
            yield codec.cancelled_chunk(prompt_tokens, generated)
            return
        raise errors.stream_ended_early()

    async def abort(self, context: Context) -> None:
        """Cancel the RPC and tell the engine to abort (the same request, this instance)."""
        entry = self._inflight.get(context.id())
        client = self._client
        if entry is None or entry.aborted or client is None:
            log.debug("abort %s: nothing in flight", context.id())
            return
        entry.aborted = True
        if entry.call is not None:
            entry.call.cancel()
        try:
            outcome = await client.abort(entry.request_id, self.instance_id)
            log.debug("abort %s: %s", entry.request_id, pb.AbortOutcome.Name(outcome.outcome))
        except grpc.aio.AioRpcError as e:
            log.warning("abort %s failed: %s: %s", entry.request_id, e.code().name, e.details())
        except grpc.aio.UsageError:
            log.debug("abort %s: channel closed (shutting down)", entry.request_id)

    def _routed_rank(self, request: GenerateRequest) -> int | None:
        info = self.info
        if info is None or info.engine_config.data_parallel_size <= 1:
            return None
        ec = info.engine_config
        return codec.routed_rank(request, ec.data_parallel_start_rank, ec.data_parallel_size)

    def _engine_request_id(self, request_id: str) -> str:
        """The engine request a Dynamo request id runs as (the same id otherwise)."""
        entry = self._inflight.get(request_id)
        return entry.request_id if entry is not None else request_id

    # -- introspection (tests, tools) ---------------------------------------

    def inflight_request_ids(self) -> Sequence[str]:
        return [e.request_id for e in self._inflight.values()]


def _trace_context(context: Context) -> Mapping[str, str] | None:
    """The request's W3C trace context (Dynamo has one for a backend only with its
    OTel layer on: DYN_LOGGING_JSONL=1 or OTEL_EXPORT_ENABLED=1)."""
    headers = context.trace_headers()
    return (trace_context(headers) or None) if headers else None


def _trace_metadata(entry: _InFlight) -> grpc.aio.Metadata:
    """A unary call's metadata: Dynamo's request id and the trace context (a stream
    start carries the trace context in its message)."""
    metadata = grpc.aio.Metadata(("x-request-id", entry.context_id))
    if entry.trace:
        for key, value in entry.trace.items():
            metadata.add(key, value)
    return metadata


def _is_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
