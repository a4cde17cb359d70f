"""RequestRunner: turns each Dynamo request into one Rollout or Generate call.

Every request in flight is in one table, under Dynamo's context id, so that an
abort, a stalled engine server or the shutdown can find and stop its call. The
id alone does not name one call: the frontend's migration sends a failed request
again under the same id, often to the same worker, and a kill meant for the
earlier attempt can arrive while the next one runs. So the table keeps each
attempt, and an abort stops only those whose own context Dynamo stopped or killed.
How a call ended is decided in one place for both kinds, because the same
cancelled call means different things: the client aborted it (answer
"cancelled"), the bridge failed it for a stalled server (retryable), or the
task itself was cancelled (pass it on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from dynamo._core import Context
from dynamo.common.backend.engine import GenerateChunk, GenerateRequest
from dynamo.common.backend.health_check import is_probe

from bridge import cache_salt, codec, errors, metrics, tito, weight_refusal
from bridge.client import EngineClient
from bridge.config import BridgeConfig
from bridge.dynamo_compat import normalize_request_token_ids
from bridge.engine_link import EngineLink
from bridge.generate_mux import PendingGenerate
from bridge.rollout_mux import PendingRollout
from bridge.rollout_text import RolloutText
from engine_contract.trace import trace_context
from engine_contract.v1 import engine_pb2 as pb
from rl_client.wire import WeightVersionRefusal

log = logging.getLogger(__name__)


class _Call(Protocol):
    """A gRPC call object, or a request on a shared stream: both cancel alike."""

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


@dataclass(eq=False)
class InFlight:
    """One engine request, so that abort() can find and stop it (each one itself:
    two attempts of a migrated request may look alike)."""

    request_id: str
    # This attempt's own context: Dynamo hands abort() another object for it.
    context: Context
    call: _Call | None = None
    aborted: bool = False
    # Failed by the bridge itself: the engine server stopped answering.
    stalled: bool = False
    # Dynamo's request id (the engine request id unless a rollout names its own).
    context_id: str = ""
    # The request's W3C trace context (traceparent, tracestate), if Dynamo has one.
    trace: Mapping[str, str] | None = None

    def ended_by_dynamo(self) -> bool:
        """Whether Dynamo stopped or killed this attempt (not only one of its id)."""
        return self.context.is_stopped() or self.context.is_killed()


class RequestRunner:
    """Runs requests on the engine server ``link`` holds; ``run()`` is Dynamo's
    ``generate()``."""

    def __init__(self, config: BridgeConfig, link: EngineLink) -> None:
        self.config = config
        self.link = link
        # Dynamo's context id -> its attempts here (more than one: a migrated request).
        self._inflight: dict[str, list[InFlight]] = {}
        self._text = RolloutText(config.model_path)

    async def run(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        """One Dynamo request: a health probe, a rollout or a streamed completion."""
        link = self.link
        if is_probe(request):
            # No engine work (nor KV-cache churn) for a probe: the server's health says it.
            if link.client is None or not await link.client.serving():
                raise errors.engine_not_serving(self.config.engine_address)
            yield {"token_ids": [], "index": 0, "finish_reason": "stop"}
            return
        normalize_request_token_ids(request)
        try:
            spec = codec.parse_request_kind(request.get("annotations"))  # type: ignore[arg-type]
        except codec.RequestError as e:
            raise errors.to_dynamo(e) from e
        client = link.client
        if client is None:
            raise errors.to_dynamo(grpc.aio.UsageError("the bridge is not started or closed"))
        if not link.serving:
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
        entry = InFlight(request_id, context, context_id=context_id, trace=trace)
        self._inflight.setdefault(context_id, []).append(entry)
        prompt_tokens = len(request.get("token_ids") or ())
        try:
            if context.is_stopped():
                log.debug("request %s: stopped before it started", context_id)
                yield codec.cancelled_chunk(prompt_tokens)
                return
            chunks = (
                self._rollout(client, entry, request, spec)
                if spec is not None
                else self._completion(client, entry, request)
            )
            generated = 0
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        generated += len(chunk["token_ids"])
                        yield chunk
                        if "finish_reason" in chunk:
                            return
            except (asyncio.CancelledError, Exception) as e:
                failure = self._failure(entry, e)
                if failure is e:
                    raise
                if failure is not None:
                    raise failure from (None if isinstance(e, asyncio.CancelledError) else e)
            else:
                if not entry.aborted:
                    raise errors.stream_ended_early()
            log.debug("request %s: aborted (%d tokens so far)", context_id, generated)
            yield codec.cancelled_chunk(prompt_tokens, generated)  # the client aborted it
        finally:
            # Dynamo closes the stream early on a client disconnect or a stop string;
            # cancelling the call aborts the engine request at once.
            if entry.call is not None and not entry.call.done():
                entry.call.cancel()
                log.debug(
                    "request %s: stream closed early, engine call cancelled", entry.request_id
                )
            attempts = self._inflight[context_id]
            attempts.remove(entry)
            if not attempts:
                del self._inflight[context_id]

    def _failure(self, entry: InFlight, exc: BaseException) -> BaseException | None:
        """What a failed engine call means: None when the client aborted it; the
        bridge's own failure of it for a stalled server (retryable); a cancellation
        of the task itself as is; anything else as a Dynamo error."""
        cancelled = isinstance(exc, asyncio.CancelledError) or _is_cancelled(exc)
        if entry.stalled and cancelled:
            return errors.engine_not_serving(self.config.engine_address)
        if entry.aborted and cancelled:
            return None
        if isinstance(exc, asyncio.CancelledError):
            return exc
        return errors.to_dynamo(exc)

    async def _rollout(
        self,
        client: EngineClient,
        entry: InFlight,
        request: GenerateRequest,
        spec: codec.RolloutSpec,
    ) -> AsyncGenerator[codec.Chunk, None]:
        """One Rollout: the whole answer in one chunk."""
        link = self.link
        message = codec.build_rollout_request(entry.request_id, request, spec)
        cache_salt.apply(message, cache_salt.requested(request, None))
        rank = self._routed_rank(request)
        if rank is not None:
            message.data_parallel_rank = rank
        streamed = link.stream_rollouts
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
        except grpc.aio.AioRpcError as e:
            refusal = await self._judge_refusal(client, entry, message, e)
            if refusal is None:
                raise
            yield codec.refusal_chunk(refusal, len(message.prompt_token_ids))
            return
        metrics.HOPS["rollout", streamed].observe(started)
        if response.instance_id and response.instance_id != link.instance_id:
            link.note_instance(response.instance_id)  # swapped under us: re-read it
        text = self._text.decode(response.token_ids) if spec.text else ""
        yield codec.rollout_chunk(response, text)

    async def _judge_refusal(
        self,
        client: EngineClient,
        entry: InFlight,
        message: pb.RolloutRequest,
        err: grpc.aio.AioRpcError,
    ) -> WeightVersionRefusal | None:
        """The refusal to answer, naming the fleet's versions, when ``err`` is the
        engine server's refusal of the rollout's weight version and the fleet's
        committed record says what it means (``bridge.weight_refusal``); None: the
        failure goes on as it came (migratable, for a refusal)."""
        store = self.link.committed_store
        if (
            store is None
            or entry.aborted
            or not message.HasField("required_weight_version")
            or not weight_refusal.is_guard_refusal(err)
        ):
            return None
        refusal = await weight_refusal.refusal_for(
            message.required_weight_version,
            client.get_load,
            store,
            self.config.client.control_timeout_s,
            instance_id=self.link.instance_id,
            request_id=entry.request_id,
        )
        if refusal is not None:
            log.log(
                logging.DEBUG if refusal.retryable else logging.WARNING,
                "rollout %s: %s",
                entry.request_id,
                refusal.message,
            )
        return refusal

    async def _completion(
        self, client: EngineClient, entry: InFlight, request: GenerateRequest
    ) -> AsyncGenerator[codec.Chunk, None]:
        """One Generate: its deltas as they come, through the one that finishes it;
        the last also carries the token bundle when the client asked for engine_data.
        A token-in/token-out request (``/inference/v1/generate``) is read and answered
        as ``bridge.tito`` says."""
        envelope = tito.envelope(request)
        plan = tito.plan(entry.request_id, request, envelope) if envelope is not None else None
        message = (
            plan.message
            if plan is not None
            else codec.build_generate_request(entry.request_id, request)
        )
        cache_salt.apply(message, cache_salt.requested(request, envelope))
        trace = (
            codec.TokenTrace(message.prompt_token_ids)
            if plan is None and codec.engine_data_requested(request)
            else None
        )
        show_logprobs = codec.logprobs_requested(request)
        rank = self._routed_rank(request)
        if rank is not None:
            message.data_parallel_rank = rank
        streamed = self.link.stream_generates
        call: PendingGenerate | grpc.aio.UnaryStreamCall = (
            client.stream_generate(message, entry.trace)
            if streamed
            else client.generate(message, _trace_metadata(entry))
        )
        entry.call = call
        started = time.perf_counter()
        async for response in call:
            chunk = (
                plan.chunk(response)
                if plan is not None
                else codec.generate_chunk(response, logprobs=show_logprobs)
            )
            if trace is not None:
                trace.add(response)
            if "finish_reason" in chunk:
                metrics.HOPS["completion", streamed].observe(started)
                if trace is not None:
                    engine_data = chunk.setdefault("engine_data", {})
                    engine_data.update(trace.engine_data(chunk["finish_reason"]))
                yield chunk
                return
            yield chunk

    async def abort(self, context: Context) -> None:
        """Cancel the RPC and tell the engine to abort (the same request, this instance)."""
        attempts = self._inflight.get(context.id(), [])
        ended = [e for e in attempts if not e.aborted and e.ended_by_dynamo()]
        client = self.link.client
        if not ended or client is None:
            # None, or a migrated request's earlier attempt killed late: the one
            # running goes on.
            log.debug("abort %s: nothing in flight (%d attempts on)", context.id(), len(attempts))
            return
        for entry in ended:
            entry.aborted = True
        running = [e for e in attempts if not e.aborted]
        for entry in ended:
            await self._abort(client, entry, running)

    async def _abort(self, client: EngineClient, entry: InFlight, running: list[InFlight]) -> None:
        """End ``entry``'s call, and its engine request unless ``running`` shares its id."""
        if entry.call is not None:
            entry.call.cancel()
        if any(e.request_id == entry.request_id for e in running):
            # The engine knows both by one id: the cancelled call alone ends this one.
            log.debug("abort %s: call cancelled (a later attempt runs)", entry.request_id)
            return
        try:
            outcome = await client.abort(entry.request_id, self.link.instance_id)
            log.debug("abort %s: %s", entry.request_id, pb.AbortOutcome.Name(outcome.outcome))
        except grpc.aio.AioRpcError as e:
            log.warning("abort %s failed: %s: %s", entry.request_id, e.code().name, e.details())
        except grpc.aio.UsageError:
            log.debug("abort %s: channel closed (shutting down)", entry.request_id)

    def fail_stalled(self) -> None:
        """The engine server has not answered for the stall timeout: fail what waits
        on it (retryable), so that nothing hangs until TCP keepalive gives up."""
        stuck = [e for e in self._entries() if e.call is not None and not e.call.done()]
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

    def cancel_all(self) -> None:
        """Cancel every call in flight (shutdown)."""
        for entry in self._entries():
            if entry.call is not None:
                entry.call.cancel()

    def _entries(self) -> list[InFlight]:
        return [entry for attempts in self._inflight.values() for entry in attempts]

    def _routed_rank(self, request: GenerateRequest) -> int | None:
        info = self.link.info
        if info is None or info.engine_config.data_parallel_size <= 1:
            return None
        ec = info.engine_config
        return codec.routed_rank(request, ec.data_parallel_start_rank, ec.data_parallel_size)

    def engine_request_id(self, request_id: str) -> str:
        """The engine request a Dynamo request id runs as (the same id otherwise)."""
        attempts = self._inflight.get(request_id)
        return attempts[-1].request_id if attempts else request_id

    def inflight_request_ids(self) -> Sequence[str]:
        return [e.request_id for e in self._entries()]


def _trace_context(context: Context) -> Mapping[str, str] | None:
    """The request's W3C trace context (Dynamo has one for a backend only with its
    OTel layer on: DYN_LOGGING_JSONL=1 or OTEL_EXPORT_ENABLED=1)."""
    headers = context.trace_headers()
    return (trace_context(headers) or None) if headers else None


def _trace_metadata(entry: InFlight) -> grpc.aio.Metadata:
    """A unary call's metadata: Dynamo's request id and the trace context (a stream
    start carries the trace context in its message)."""
    metadata = grpc.aio.Metadata(("x-request-id", entry.context_id))
    if entry.trace:
        for key, value in entry.trace.items():
            metadata.add(key, value)
    return metadata


def _is_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
