"""The contract's RPCs: decode, admit, run on the backend, encode.

Business state lives in the registry (requests), the hub (KV events) and the
backend (the engine); the servicer only wires them per call and maps failures
to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server import admission, codec
from engine_server.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineInfo,
    EngineOutput,
    EngineRequestError,
    FinishReason,
)
from engine_server.config import GenerationDefaults, ServerConfig
from engine_server.errors import (
    Draining,
    EngineFailed,
    EngineRejected,
    EngineUnavailable,
    InvalidRequest,
    NotReady,
    RevisionRejected,
    ServerError,
    StreamStalled,
)
from engine_server.kv_events import KvEventHub
from engine_server.registry import AbortOutcome, ActiveRequest, RequestRegistry
from engine_server.rollout_stream import RolloutStream

log = logging.getLogger(__name__)

ABORT_OUTCOMES = {
    AbortOutcome.ABORTED: pb.ABORT_OUTCOME_ABORTED,
    AbortOutcome.ALREADY_FINISHED: pb.ABORT_OUTCOME_ALREADY_FINISHED,
    AbortOutcome.NOT_FOUND: pb.ABORT_OUTCOME_NOT_FOUND,
}


@dataclass
class Readiness:
    """What the servicer may serve now; set by the server as the engine comes and goes."""

    info: EngineInfo | None = None
    defaults: GenerationDefaults | None = None
    draining: bool = False
    engine_dead: str | None = None
    start_time_unix_nanos: int = 0


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(
        self,
        backend: EngineBackend,
        config: ServerConfig,
        instance_id: str,
        registry: RequestRegistry,
        hub: KvEventHub,
        readiness: Readiness,
    ) -> None:
        self._backend = backend
        self._config = config
        self._limits = config.limits
        self._instance_id = instance_id
        self._registry = registry
        self._hub = hub
        self._ready = readiness
        self._streams: set[RolloutStream] = set()

    # -- helpers -----------------------------------------------------------

    def _serving(self) -> tuple[EngineInfo, GenerationDefaults]:
        ready = self._ready
        if ready.draining:
            raise Draining("server is draining (shutting down); send new requests elsewhere")
        if ready.engine_dead is not None:
            raise EngineUnavailable(f"engine is not serving: {ready.engine_dead}")
        if ready.info is None or ready.defaults is None:
            raise NotReady("engine is starting; not ready yet")
        return ready.info, ready.defaults

    async def _outputs(
        self, plan: admission.Plan, entry: ActiveRequest
    ) -> AsyncIterator[EngineOutput]:
        """The backend's outputs for one request; the engine request never outlives this."""
        request_id = plan.request_id
        finished = False
        stream = self._backend.generate(request_id, plan.prompt_token_ids, plan.spec)
        try:
            async for out in stream:
                if out.finished:
                    finished = True
                    if entry.aborted_for_shutdown and out.finish_reason is FinishReason.ABORTED:
                        raise Draining(
                            "server shut down before the request finished (grace period over); "
                            "retry it elsewhere"
                        )
                elif entry.abort_requested:
                    # An Abort that raced the engine's admission of the request
                    # found nothing to abort; repeat it now that the engine has it.
                    await self._backend.abort(request_id)
                yield out
                if finished:
                    return
        except EngineRequestError as e:
            raise EngineRejected(str(e)) from e
        except EngineDeadError as e:
            raise EngineUnavailable(f"engine died: {e}") from e
        finally:
            await stream.aclose()
            if not finished:
                # Cancelled call, dead client, or a failure: nobody will read
                # this request's output any more.
                await self._backend.abort(request_id)
        if not finished:
            raise EngineFailed("engine ended the request without a final output")

    @staticmethod
    def _usage(plan: admission.Plan, last: EngineOutput | None, completion: int) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(plan.prompt_token_ids),
            completion_tokens=completion,
            cached_prompt_tokens=last.num_cached_tokens if last is not None else 0,
        )

    # -- RPCs --------------------------------------------------------------

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        try:
            if 0 < request.client_revision < engine_contract.MINIMUM_CLIENT_REVISION:
                raise RevisionRejected(
                    f"client_revision {request.client_revision} is older than this server "
                    f"accepts (minimum {engine_contract.MINIMUM_CLIENT_REVISION}, server "
                    f"revision {engine_contract.CONTRACT_REVISION}); upgrade the client"
                )
            info = self._ready.info
            defaults = self._ready.defaults
            if info is None or defaults is None:
                raise NotReady("engine is starting; not ready yet")
        except ServerError as e:
            await context.abort(e.code, str(e))
        limits = self._limits
        return pb.GetServerInfoResponse(
            contract_revision=engine_contract.CONTRACT_REVISION,
            minimum_client_revision=engine_contract.MINIMUM_CLIENT_REVISION,
            instance_id=self._instance_id,
            model_name=info.model_name,
            model_path=info.model_path,
            engine_config=pb.EngineConfig(
                context_length=info.context_length,
                kv_block_size=info.kv_block_size,
                total_kv_blocks=info.total_kv_blocks,
                max_running_sequences=info.max_running_sequences,
                max_batched_tokens=info.max_batched_tokens,
                data_parallel_size=info.data_parallel_size,
            ),
            eos_token_ids=info.eos_token_ids,
            vocab_size=info.vocab_size,
            generation_defaults=pb.GenerationDefaults(
                temperature=defaults.temperature,
                top_p=defaults.top_p,
                top_k=defaults.top_k,
                max_new_tokens=defaults.max_new_tokens,
                stop_token_ids=defaults.stop_token_ids,
                stop_strings=defaults.stop_strings,
                ignore_eos=defaults.ignore_eos,
                bad_words=defaults.bad_words,
            ),
            backend_name=info.backend_name,
            backend_version=info.backend_version,
            limits=pb.ServerLimits(
                max_stop_strings=limits.max_stop_strings,
                max_stop_string_length=limits.max_stop_string_length,
                max_request_id_length=limits.max_request_id_length,
                max_message_bytes=limits.max_message_bytes,
                max_top_logprobs=limits.max_top_logprobs,
            ),
            start_time_unix_nanos=self._ready.start_time_unix_nanos,
            routed_experts_available=info.reports_routed_experts,
        )

    async def Rollout(
        self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.RolloutResponse:
        try:
            response = pb.RolloutResponse()
            await self._answer_rollout(request, response)
            return response
        except ServerError as e:
            await context.abort(e.code, str(e))
        raise AssertionError("unreachable: context.abort raises")

    async def Rollouts(
        self,
        request_iterator: AsyncIterator[pb.RolloutsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        stream = RolloutStream(
            self._answer_rollout,
            context,
            max_message_bytes=self._limits.max_message_bytes,
            write_timeout_s=self._config.stream_write_timeout_s,
        )
        self._streams.add(stream)
        try:
            await stream.serve(request_iterator)
        except ServerError as e:
            await context.abort(e.code, str(e))
        finally:
            self._streams.discard(stream)

    def close_streams(self) -> None:
        """Shutting down: Rollouts streams answer what runs on them, then end."""
        for stream in self._streams:
            stream.close()

    async def _answer_rollout(self, request: pb.RolloutRequest, into: pb.RolloutResponse) -> None:
        """A Rollout's answer, written into ``into``; raises ServerError."""
        info, defaults = self._serving()
        plan = admission.plan_rollout(request, info, defaults, self._limits)
        await self._rollout(plan, into)

    async def _rollout(
        self, plan: admission.Plan, response: pb.RolloutResponse | None = None
    ) -> pb.RolloutResponse:
        if response is None:
            response = pb.RolloutResponse()
        response.request_id = plan.request_id
        response.instance_id = self._instance_id
        with self._registry.track(plan.request_id) as entry:
            if plan.generates_nothing:
                # NeMo RL's "nothing generated": the prompt alone, untruncated.
                response.finish_reason = pb.FINISH_REASON_LENGTH
                response.usage.CopyFrom(self._usage(plan, None, 0))
                return response
            tokens = response.token_ids
            logprobs = response.logprobs
            last: EngineOutput | None = None
            async for out in self._outputs(plan, entry):
                tokens.extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs.extend(out.logprobs)
                last = out
        assert last is not None
        if len(logprobs) != len(tokens):
            raise EngineFailed(f"engine returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        self._finish(response, plan, last, len(tokens))
        response.truncated = response.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) > 0
        if plan.spec.return_routed_experts:
            response.r3_stats.CopyFrom(
                codec.r3_stats(last.routed_experts, len(plan.prompt_token_ids), len(tokens))
            )
        return response

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Explicit writes, each bounded by the watchdog: a client that stops
        # reading would otherwise park the write (HTTP/2 flow control) and keep
        # the engine request alive for as long as the connection lives.
        try:
            info, _ = self._serving()
            plan = admission.plan_generate(request, info, self._limits)
            with self._registry.track(plan.request_id) as entry:
                if plan.generates_nothing:
                    await self._write(
                        context,
                        pb.GenerateResponse(
                            finished=pb.GenerateFinished(
                                finish_reason=pb.FINISH_REASON_LENGTH,
                                usage=self._usage(plan, None, 0),
                                instance_id=self._instance_id,
                            )
                        ),
                    )
                    return
                want_logprobs = plan.spec.logprobs is not None
                want_top = bool(plan.spec.logprobs)
                completion = 0
                # aclosing: a stalled write leaves the loop with the generator
                # suspended; closing it now aborts the engine request now.
                async with contextlib.aclosing(self._outputs(plan, entry)) as outputs:
                    async for out in outputs:
                        completion += len(out.token_ids)
                        message = pb.GenerateResponse(token_ids=out.token_ids)
                        if want_logprobs:
                            if out.logprobs is None or len(out.logprobs) != len(out.token_ids):
                                raise EngineFailed(
                                    "engine returned logprobs not aligned with tokens"
                                )
                            message.logprobs.extend(out.logprobs)
                        if want_top and out.top_logprobs is not None:
                            for alternatives in out.top_logprobs:
                                message.top_logprobs.add(
                                    token_ids=[t for t, _ in alternatives],
                                    logprobs=[lp for _, lp in alternatives],
                                )
                        if out.finished:
                            self._finish(message.finished, plan, out, completion)
                        await self._write(context, message)
        except ServerError as e:
            await context.abort(e.code, str(e))

    async def _write(self, context: grpc.aio.ServicerContext, message: pb.GenerateResponse) -> None:
        """One stream write, bounded by ``stream_write_timeout_s`` (None: unbounded).
        A timer per write (asyncio.timeout: no extra task), nothing more."""
        timeout = self._config.stream_write_timeout_s
        if timeout is None:
            await context.write(message)
            return
        try:
            async with asyncio.timeout(timeout):
                await context.write(message)
        except TimeoutError:
            raise StreamStalled(timeout) from None

    def _finish(
        self,
        finished: pb.GenerateFinished | pb.RolloutResponse,
        plan: admission.Plan,
        out: EngineOutput,
        completion: int,
    ) -> None:
        """The fields a last Generate message and a Rollout answer share."""
        reason = out.finish_reason or FinishReason.ERROR
        finished.finish_reason = codec.FINISH_REASONS[reason]
        match = codec.stop_match(out.stop_reason) if reason is FinishReason.STOP else None
        if match is not None:
            finished.matched_stop.CopyFrom(match)
        finished.usage.CopyFrom(self._usage(plan, out, completion))
        finished.instance_id = self._instance_id
        if plan.spec.return_routed_experts and out.routed_experts is not None:
            finished.routed_experts.CopyFrom(codec.routed_experts(out.routed_experts))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            target = request.WhichOneof("target")
            if target is None:
                raise InvalidRequest("target", "set request_id, or all to true")
            if target == "all" and not request.all:
                raise InvalidRequest("all", "must be true when set")
            if target == "request_id" and not request.request_id:
                raise InvalidRequest("request_id", "must not be empty")
        except ServerError as e:
            await context.abort(e.code, str(e))
        if request.instance_id and request.instance_id != self._instance_id:
            return pb.AbortResponse(outcome=pb.ABORT_OUTCOME_NOT_FOUND)
        if target == "all":
            count = await self._registry.abort_all()
            outcome = pb.ABORT_OUTCOME_ABORTED if count else pb.ABORT_OUTCOME_NOT_FOUND
            return pb.AbortResponse(outcome=outcome, aborted_count=count)
        result = await self._registry.abort(request.request_id)
        return pb.AbortResponse(
            outcome=ABORT_OUTCOMES[result],
            aborted_count=1 if result is AbortOutcome.ABORTED else 0,
        )

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        try:
            stream = self._hub.subscribe(request)
            # Headers once the position is fixed, so that a client may wait for
            # them before it makes the engine emit what it wants to see; and
            # now, because the stream may stay quiet for long.
            await context.send_initial_metadata(())
            async for message in stream:
                yield message
        except ServerError as e:
            await context.abort(e.code, str(e))

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        try:
            self._serving()
            return pb.ResetPrefixCacheResponse(reset=await self._backend.reset_prefix_cache())
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine died: {e}")
        except ServerError as e:
            await context.abort(e.code, str(e))
        raise AssertionError("unreachable: context.abort raises")

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        response = pb.GetLoadResponse(registered_requests=len(self._registry))
        if self._ready.info is not None:
            load = self._backend.load()
            response.running_requests = load.running
            response.waiting_requests = load.waiting
            response.kv_blocks_used = load.kv_blocks_used
            response.kv_blocks_total = load.kv_blocks_total
        return response
