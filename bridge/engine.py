"""BridgeEngine: a Dynamo LLMEngine that forwards every request to one engine server.

Only Dynamo's lifecycle lives here, so that what Dynamo calls and when reads in
one place: the engine server itself (its instance, transports, refusals) is
``engine_link``'s, the requests are ``request_runner``'s, the KV events
``kv_relay``'s, the worker's place in discovery ``registration``'s, and the RL
admin routes ``rl_admin``'s.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from dynamo._core import Context
from dynamo.common.backend.engine import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.health_check import build_health_check_payload
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.worker import WorkerConfig

from bridge import metrics
from bridge.admin.instance_alias import instance_key, model_card_key
from bridge.admin.rl_admin import RlAdmin, weight_world_size
from bridge.admin.rl_endpoint import RlEndpoint
from bridge.admin.surface import AdminSurface
from bridge.admin.system_server import SystemPort, SystemServer
from bridge.config import BridgeConfig, parse_args
from bridge.dynamo_compat import token_in_token_out_runtime_data
from bridge.engine_link import EngineLink
from bridge.engine_metrics import EngineSeries
from bridge.fleet_record import runtime_data
from bridge.kv_relay import KvRelay
from bridge.kv_view import RouterView
from bridge.lease_note import LeaseNote
from bridge.logging import configure_bridge_logging
from bridge.registration import EXIT_REGISTRATION_LOST, Registration
from bridge.request_runner import RequestRunner
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


class BridgeEngine(LLMEngine):
    """Dynamo's side of one engine server: registers what the server reports, relays
    its KV events, and turns each Dynamo request into one Rollout or Generate call."""

    def __init__(self, config: BridgeConfig, system_port: SystemPort | None = None) -> None:
        self.config = config
        self.registration = Registration(
            config.discovery_backend,
            endpoint_path=f"{config.namespace}/{config.component}/{config.endpoint}",
            on_lost=self._registration_lost,
        )
        self.link = EngineLink(config, self.registration)
        self.runner = RequestRunner(config, self.link)
        # What the process exits with (bridge.__main__): non-zero when the bridge
        # gave up on its registration, so that a supervisor restarts it.
        self.exit_code = 0
        self.rl_admin = RlAdmin(
            lambda: self.link.client,
            self.registration,
            self.runner.engine_request_id,
            watch=lambda: self.link.watch,
        )
        # Its routes in dynamo.vllm's, vLLM's and the Dynamo sidecar's spellings.
        self.admin_surface = AdminSurface(self.rl_admin)
        # vLLM's series, added to the system port's /metrics as dynamo.vllm has them.
        self.engine_series = EngineSeries(
            lambda: (self.link.client, self.link.info), config.client.metrics_timeout_s
        )
        self._system = (
            SystemServer(
                system_port,
                self.admin_surface.engine_routes,
                config.admin_token,
                extra_metrics=self.engine_series.text,
                http_routes=self.admin_surface.http_routes,
            )
            if system_port is not None
            else None
        )
        self._rl_endpoint: RlEndpoint | None = None
        self._leases: LeaseNote | None = None
        self._relay: KvRelay | None = None
        self._worker_id = 0
        self._closed = False

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

    async def register_prometheus(self, metrics_handle: Any) -> None:
        """The bridge's own metrics (``bridge.metrics``) in the worker's /metrics; the
        engine's series (added by the system server) get the same labels."""
        from dynamo.common.backend.metrics import register_engine_registry

        register_engine_registry(metrics_handle, metrics.REGISTRY)
        # dynamo.vllm names the model of its engine's series by its served name,
        # as ``model`` and ``model_name`` (Dynamo's ``model`` here is the path).
        served = self.config.served_model_name or self.config.model_path
        self.engine_series.labels = {
            **(metrics_handle.auto_labels or {}),
            "model": served,
            "model_name": served,
        }

    async def start(self, worker_id: int) -> EngineConfig:
        cfg = self.config
        if self._system is not None:
            await self._system.check_internal_port()
            await self._system.start()
        self._worker_id = worker_id
        info = await self.link.start(worker_id, on_stalled=self.runner.fail_stalled)
        log.info("registering endpoint types %s: %s", cfg.endpoint_types, cfg.endpoint_types_reason)
        system = self._system.address if self._system is not None else None
        # What trainers read (the fleet record), and /inference/v1/generate where
        # this Dynamo serves it (bridge.tito answers it).
        data = runtime_data(cfg, system) | token_in_token_out_runtime_data()
        return _engine_config(cfg, info, data)

    async def kv_event_sources(self) -> list[KvEventSource]:
        client, info = self.link.client, self.link.info
        if client is None or info is None or not self.config.kv_events:
            return []
        ec = info.engine_config
        if ec.kv_block_size <= 0:
            return []
        ranks = max(1, ec.data_parallel_size)
        view = RouterView(
            ec.kv_block_size,
            ranks=ranks,
            on_instance_change=self.link.note_instance,
            max_delay_ms=self.config.kv_max_delay_ms,
        )
        relay = self._relay = KvRelay(client, view)
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
        cfg = self.config
        # Revoked by a supervisor as soon as this bridge dies (bridge.lease_note).
        self._leases = LeaseNote.from_env(cfg.discovery_backend)
        if self._leases is not None:
            # The model card stays while the worker is out of the router's pool.
            where = (cfg.namespace, cfg.component, cfg.endpoint, self._worker_id)
            self._leases.follow(instance_key(*where), model_card_key(*where))
        if self.config.enable_rl:
            system_url = self._system.address.url if self._system is not None else None
            info = self.link.info
            self._rl_endpoint = RlEndpoint(
                self.config,
                self.admin_surface.listed(),
                system_url,
                endpoint.connection_id(),
                world_size=weight_world_size(info) if info is not None else 1,
            )
            await self._rl_endpoint.start()
            if self._leases is not None:
                self._leases.follow(self._rl_endpoint.carrier_key)

    def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        """The request's chunks (``RequestRunner.run``, handed on as is: no hop per chunk)."""
        return self.runner.run(request, context)

    async def abort(self, context: Context) -> None:
        """Cancel the RPC and tell the engine to abort (the same request, this instance)."""
        await self.runner.abort(context)

    async def health_check_payload(self) -> dict[str, Any] | None:
        """Dynamo's canary (on with ``DYN_HEALTH_CHECK_ENABLED``, shown on the
        ``DYN_SYSTEM_PORT`` /health): ``generate()`` answers it from the engine
        server's gRPC health, so /health turns notready while the engine is down."""
        info = self.link.info
        eos = info.eos_token_ids[0] if info is not None and info.eos_token_ids else 0
        return build_health_check_payload(eos)

    async def cleanup(self) -> None:
        """Stop the KV stream, then close the channel; null-safe and idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.registration.stop()
        await self.link.stop_following()
        parts = (self._leases, self._rl_endpoint, self._system, self._relay)
        self._leases = self._rl_endpoint = self._system = self._relay = None
        for part in parts:
            if part is not None:
                await part.stop()
        self.runner.cancel_all()
        await self.link.close()
        log.info("bridge cleaned up")

    def _registration_lost(self) -> None:
        self.exit_code = EXIT_REGISTRATION_LOST
        os.kill(os.getpid(), signal.SIGTERM)  # Dynamo's orderly shutdown, then exit 75

    def inflight_request_ids(self) -> Sequence[str]:
        """The engine request ids in flight (tests, tools)."""
        return self.runner.inflight_request_ids()


def _engine_config(
    cfg: BridgeConfig, info: pb.GetServerInfoResponse, data: dict[str, Any] | None = None
) -> EngineConfig:
    """What Dynamo registers for the worker: the engine server's model and shape, and
    in its card's ``runtime_data`` what a trainer needs to refit it (``bridge.fleet_record``)."""
    ec = info.engine_config
    return EngineConfig(
        model=cfg.model_path,
        served_model_name=cfg.served_model_name or info.model_name or None,
        runtime_data=data,
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
