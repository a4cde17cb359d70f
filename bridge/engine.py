"""BridgeEngine: a Dynamo LLMEngine that forwards every request to one engine server.

Thin glue: request mapping lives in ``codec``, transport in ``client``, error
mapping in ``errors``, KV events in ``kv_relay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
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
from bridge import codec, errors
from bridge.client import EngineClient, IncompatibleServerError
from bridge.config import BridgeConfig, parse_args
from bridge.kv_relay import KvRelay
from bridge.kv_view import RouterView
from bridge.logging import configure_bridge_logging
from bridge.rollout_mux import PendingRollout
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


class BridgeEngine(LLMEngine):
    """Dynamo's side of one engine server: registers what the server reports, relays
    its KV events, and turns each Dynamo request into one Rollout or Generate call."""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        self._client: EngineClient | None = None
        self._relay: KvRelay | None = None
        self.info: pb.GetServerInfoResponse | None = None
        self.instance_id = ""
        # Keyed by Dynamo's context id.
        self._inflight: dict[str, _InFlight] = {}
        self._closed = False
        self._stream_rollouts = False

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[BridgeEngine, WorkerConfig]:
        bridge_config, worker_config = parse_args(argv)
        configure_bridge_logging(bridge_config.log_level)
        return cls(bridge_config), worker_config

    # -- lifecycle ---------------------------------------------------------

    async def start(self, worker_id: int) -> EngineConfig:
        cfg = self.config
        log.info(
            "worker %s: connecting to engine server at %s (waiting up to %.0fs)",
            worker_id,
            cfg.engine_address,
            cfg.connect_timeout_s,
        )
        self._client = EngineClient(cfg.engine_address, cfg.client)
        info = await self._client.wait_ready(cfg.connect_timeout_s)
        self.info, self.instance_id = info, info.instance_id
        self._client.use_server_limits(info)
        self._stream_rollouts = self._choose_rollout_transport(info)
        ec = info.engine_config
        log.info(
            "engine server %s ready: %s (%s %s, contract %d), context %d, block size %d, "
            "rollouts %s",
            info.instance_id,
            info.model_name,
            info.backend_name,
            info.backend_version,
            info.contract_revision,
            ec.context_length,
            ec.kv_block_size,
            "multiplexed on a stream" if self._stream_rollouts else "one call each",
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
            ),
        )

    def _choose_rollout_transport(self, info: pb.GetServerInfoResponse) -> bool:
        """True to stream rollouts; refuses a server too old for a required stream."""
        serves_stream = info.contract_revision >= engine_contract.ROLLOUTS_STREAM_REVISION
        transport = self.config.rollout_transport
        if transport == "stream" and not serves_stream:
            raise IncompatibleServerError(
                f"engine server at {self.config.engine_address} implements contract revision "
                f"{info.contract_revision}, without the Rollouts stream (revision "
                f"{engine_contract.ROLLOUTS_STREAM_REVISION}) that --rollout-transport "
                "stream needs: upgrade the engine server or use auto"
            )
        return transport == "stream" or (transport == "auto" and serves_stream)

    async def kv_event_sources(self) -> list[KvEventSource]:
        if self._client is None or self.info is None or not self.config.kv_events:
            return []
        block_size = self.info.engine_config.kv_block_size
        if block_size <= 0:
            return []
        view = RouterView(
            block_size,
            on_instance_change=self._set_instance,
            max_delay_ms=self.config.kv_max_delay_ms,
        )
        self._relay = KvRelay(self._client, view)
        self._relay.start()
        return [PushSource(on_ready=self._relay.on_ready, dp_rank=0)]

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
        if instance_id != self.instance_id:
            log.info("engine server restarted: instance %s -> %s", self.instance_id, instance_id)
            self.instance_id = instance_id

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
        context_id = context.id()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: %s", context_id, {k: v for k, v in request.items() if k != "token_ids"}
            )
        request_id = (spec.request_id if spec is not None else None) or context_id
        entry = _InFlight(request_id)
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
            call: PendingRollout | grpc.aio.UnaryUnaryCall = (
                client.stream_rollout(message) if self._stream_rollouts else client.rollout(message)
            )
            entry.call = call
            response = await call
            chunk = codec.rollout_chunk(response)
        except asyncio.CancelledError:
            if not entry.aborted:
                raise
            yield codec.cancelled_chunk(len(request["token_ids"]))
            return
        except Exception as e:
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
            call = client.generate(message)
            entry.call = call
            async for response in call:
                chunk = codec.generate_chunk(response)
                generated += len(chunk["token_ids"])
                yield chunk
                if "finish_reason" in chunk:
                    return
        except asyncio.CancelledError:
            if not entry.aborted:
                raise
        except Exception as e:
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

    # -- introspection (tests, tools) ---------------------------------------

    def inflight_request_ids(self) -> Sequence[str]:
        return [e.request_id for e in self._inflight.values()]


def _is_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
