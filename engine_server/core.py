"""The serving core: what a request means, whatever carries it.

``ServerCore`` owns the request registry, the KV-event hub, the engine's
serving state and its refit cycle (``refit``: the rules and state; ``updates``:
the ways new weights arrive), and answers the contract's operations (server info, rollout,
generate, abort, prefix-cache reset, load) in contract messages. It knows no
transport: the gRPC servicer decodes a call, calls the core and encodes its
answer or error; the ``Rollouts`` stream and the benchmark's one-process worker
call the very same methods. Failures are ``ServerError``s, each with its status.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_server import admission, codec, metrics, tracing
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
    CapacityExceeded,
    Draining,
    EngineFailed,
    EngineRejected,
    EngineUnavailable,
    InvalidRequest,
    NotReady,
    RevisionRejected,
    WeightVersionMismatch,
)
from engine_server.kv_events import KvEventHub
from engine_server.refit_control import RefitControl
from engine_server.registry import AbortOutcome, ActiveRequest, RequestRegistry
from engine_server.weight_updates import WeightUpdates

log = logging.getLogger(__name__)

ABORT_OUTCOMES = {
    AbortOutcome.ABORTED: pb.ABORT_OUTCOME_ABORTED,
    AbortOutcome.ALREADY_FINISHED: pb.ABORT_OUTCOME_ALREADY_FINISHED,
    AbortOutcome.NOT_FOUND: pb.ABORT_OUTCOME_NOT_FOUND,
}


@dataclass(frozen=True)
class Serving:
    """The engine as requests see it once it is ready."""

    info: EngineInfo
    defaults: GenerationDefaults


class ServerCore:
    """One engine served under one instance id. All methods run on the server's loop."""

    def __init__(self, backend: EngineBackend, config: ServerConfig, instance_id: str) -> None:
        self.backend = backend
        self.config = config
        self.instance_id = instance_id
        self.registry = RequestRegistry(backend.abort, config.finished_ids_remembered)
        self.hub = KvEventHub(
            instance_id,
            config.kv_replay_batches,
            config.kv_snapshot_chunk_blocks,
            config.limits.max_message_bytes,
        )
        self.refit = RefitControl(
            backend,
            self.registry,
            config=config.refit,
            on_weights_change=self._end_guarded,
        )
        # The ways new weights arrive, each under the refit control's rules.
        self.updates = WeightUpdates(self.refit, backend, config.refit)
        self._serving: Serving | None = None
        self.draining = False
        self.engine_dead: str | None = None
        self.start_time_unix_nanos = 0

    # -- serving state -------------------------------------------------------

    async def start_engine(self) -> EngineInfo:
        """Start the backend (its KV events feed the hub); ready once this returns."""
        try:
            info = await self.backend.start(self.hub.publish)
        except Exception as e:
            self.engine_dead = f"failed to start: {e}"
            raise
        self.hub.set_ranks(info.data_parallel_size)
        defaults = admission.resolve_defaults(self.config.defaults, info)
        await self.refit.start()
        self.start_time_unix_nanos = time.time_ns()
        self._serving = Serving(info, defaults)
        return info

    @property
    def info(self) -> EngineInfo | None:
        return self._serving.info if self._serving is not None else None

    def admit(self) -> None:
        """Room for one more request? CapacityExceeded (retryable) when not."""
        limits = self.config.limits
        if len(self.registry) >= limits.max_requests_in_flight:
            raise CapacityExceeded(
                "max_requests_in_flight",
                limits.max_requests_in_flight,
                f"{len(self.registry)} requests are in flight on this server",
            )
        if limits.max_waiting_requests:
            waiting = self.backend.load().waiting
            if waiting >= limits.max_waiting_requests:
                raise CapacityExceeded(
                    "max_waiting_requests",
                    limits.max_waiting_requests,
                    f"the engine has {waiting} requests waiting",
                )

    def serving(self) -> Serving:
        """The ready engine; raises UNAVAILABLE while it is not serving requests."""
        if self.draining:
            raise Draining("server is draining (shutting down); send new requests elsewhere")
        if self.engine_dead is not None:
            raise EngineUnavailable(f"engine is not serving: {self.engine_dead}")
        if self.refit.broken is not None:
            raise EngineUnavailable(f"engine is not serving: {self.refit.broken}")
        if self._serving is None:
            raise NotReady("engine is starting; not ready yet")
        return self._serving

    # -- operations ----------------------------------------------------------

    def server_info(self, client_revision: int) -> pb.GetServerInfoResponse:
        if 0 < client_revision < engine_contract.MINIMUM_CLIENT_REVISION:
            raise RevisionRejected(
                f"client_revision {client_revision} is older than this server accepts "
                f"(minimum {engine_contract.MINIMUM_CLIENT_REVISION}, server revision "
                f"{engine_contract.CONTRACT_REVISION}); upgrade the client"
            )
        if self._serving is None:  # answered while draining, and after the engine died
            raise NotReady("engine is starting; not ready yet")
        info, defaults = self._serving.info, self._serving.defaults
        limits = self.config.limits
        return pb.GetServerInfoResponse(
            contract_revision=engine_contract.CONTRACT_REVISION,
            minimum_client_revision=engine_contract.MINIMUM_CLIENT_REVISION,
            instance_id=self.instance_id,
            model_name=info.model_name,
            model_path=info.model_path,
            # Every field of the message, as EngineInfo names it.
            engine_config=pb.EngineConfig(
                **{f.name: getattr(info, f.name) for f in pb.EngineConfig.DESCRIPTOR.fields}
            ),
            eos_token_ids=info.eos_token_ids,
            vocab_size=info.vocab_size,
            generation_defaults=pb.GenerationDefaults(
                **{
                    f.name: getattr(defaults, f.name)
                    for f in dataclasses.fields(GenerationDefaults)
                }
            ),
            backend_name=info.backend_name,
            backend_version=info.backend_version,
            limits=pb.ServerLimits(
                **{f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)}
            ),
            start_time_unix_nanos=self.start_time_unix_nanos,
            routed_experts_available=info.reports_routed_experts,
            rl_capabilities=pb.RlCapabilities(**dataclasses.asdict(self.backend.rl_capabilities())),
            refit_state=self.refit.state(),
        )

    async def rollout(
        self, request: pb.RolloutRequest, into: pb.RolloutResponse | None = None
    ) -> pb.RolloutResponse:
        """One rollout's answer (written into ``into`` when given, to spare a copy)."""
        arrived = time.perf_counter()
        serving = self.serving()
        plan = admission.plan_rollout(request, serving.info, serving.defaults, self.config.limits)
        self._check_version(plan)
        self.admit()
        tracing.started("rollout", plan.request_id)
        response = pb.RolloutResponse() if into is None else into
        response.request_id = plan.request_id
        response.instance_id = self.instance_id
        with self.registry.track(plan.request_id) as entry:
            if plan.generates_nothing:
                # NeMo RL's "nothing generated": the prompt alone, untruncated.
                response.finish_reason = pb.FINISH_REASON_LENGTH
                response.usage.CopyFrom(_usage(plan, None, 0))
                metrics.ROLLOUT.finished(arrived, None, response.finish_reason, response.usage)
                return response
            await self.refit.gate(entry)
            if entry.abort_requested:  # aborted while waiting for a paused engine
                response.finish_reason = pb.FINISH_REASON_ABORTED
                response.usage.CopyFrom(_usage(plan, None, 0))
                metrics.ROLLOUT.finished(arrived, None, response.finish_reason, response.usage)
                return response
            self._guard(plan, entry)
            engine_from = time.perf_counter()
            tokens = response.token_ids
            logprobs = response.logprobs
            last: EngineOutput | None = None
            async for out in self._outputs(plan, entry):
                tokens.extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs.extend(out.logprobs)
                last = out
        if last is None:  # _outputs raises rather than end without a final output
            raise EngineFailed("engine ended the request without any output")
        if len(logprobs) != len(tokens):
            raise EngineFailed(f"engine returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        self._finish(response, plan, last, len(tokens), entry)
        response.truncated = response.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) > 0
        if plan.spec.return_routed_experts:
            response.r3_stats.CopyFrom(
                codec.r3_stats(last.routed_experts, len(plan.prompt_token_ids), len(tokens))
            )
        metrics.ROLLOUT.finished(arrived, engine_from, response.finish_reason, response.usage)
        return response

    async def generate(
        self, request: pb.GenerateRequest
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """An ordinary completion's messages: deltas, the last one with ``finished``.

        Close the iterator early (``contextlib.aclosing``) and the engine
        request is aborted at once.
        """
        arrived = time.perf_counter()
        serving = self.serving()
        plan = admission.plan_generate(request, serving.info, self.config.limits)
        self._check_version(plan)
        self.admit()
        tracing.started("completion", plan.request_id)
        with self.registry.track(plan.request_id) as entry:
            if plan.generates_nothing:
                yield self._nothing_generated(plan, pb.FINISH_REASON_LENGTH, arrived)
                return
            await self.refit.gate(entry)
            if entry.abort_requested:  # aborted while waiting for a paused engine
                yield self._nothing_generated(plan, pb.FINISH_REASON_ABORTED, arrived)
                return
            self._guard(plan, entry)
            engine_from = time.perf_counter()
            want_logprobs = plan.spec.logprobs is not None
            want_top = bool(plan.spec.logprobs)
            completion = 0
            outputs = self._outputs(plan, entry)
            try:
                async for out in outputs:
                    completion += len(out.token_ids)
                    message = pb.GenerateResponse(token_ids=out.token_ids)
                    if want_logprobs:
                        if out.logprobs is None or len(out.logprobs) != len(out.token_ids):
                            raise EngineFailed("engine returned logprobs not aligned with tokens")
                        message.logprobs.extend(out.logprobs)
                    if want_top and out.top_logprobs is not None:
                        for alternatives in out.top_logprobs:
                            message.top_logprobs.add(
                                token_ids=[t for t, _ in alternatives],
                                logprobs=[lp for _, lp in alternatives],
                            )
                    if out.finished:
                        done = message.finished
                        self._finish(done, plan, out, completion, entry)
                        metrics.GENERATE.finished(
                            arrived, engine_from, done.finish_reason, done.usage
                        )
                    yield message
            finally:
                # A consumer that stops early (a stalled write, a cancelled call)
                # leaves the engine's stream suspended: close it now, which
                # aborts the engine request now.
                await outputs.aclose()

    # -- version-guarded requests (revision 8) -------------------------------------

    def _check_version(self, plan: admission.Plan) -> None:
        """Refuse (retryable) a version-guarded request the weights here cannot serve:
        labelled another version, or part way through an update (the label names
        none of what serves)."""
        required = plan.required_weight_version
        if required is None:
            return
        mixed = self.refit.transfer.mixed_weights()
        if required != self.refit.version or mixed is not None:
            metrics.WEIGHT_VERSION_REFUSALS.inc()
            raise WeightVersionMismatch(required, self.refit.version, mixed=mixed)

    def _guard(self, plan: admission.Plan, entry: ActiveRequest) -> None:
        """Checked again past the gate (a refit may have relabelled the weights while
        it waited); from here a weight change ends it instead (``_end_guarded``)."""
        self._check_version(plan)
        entry.required_version = plan.required_weight_version

    async def _end_guarded(self, version: str | None) -> None:
        """Just before the weights change (``version`` None) or their label becomes
        ``version``: end every version-guarded request in the engine that would get
        tokens of another version. Each answers what it made so far, finish reason
        WEIGHT_VERSION_CHANGED: a KEEP-mode pause would otherwise continue it on the
        new weights. Never raises (the refit goes on whatever happens here)."""
        for entry in self.registry.guarded():
            if entry.weights_changed or entry.required_version == version:
                continue
            entry.weights_changed = True
            metrics.ABORT_WEIGHT_CHANGE.inc()
            try:
                await self.backend.abort(entry.request_id)
            except Exception as e:  # a dead engine fails the request by itself
                log.warning("ending %s for a weight change failed: %r", entry.request_id, e)

    async def abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        target = request.WhichOneof("target")
        if target is None:
            raise InvalidRequest("target", "set request_id, or all to true")
        if target == "all" and not request.all:
            raise InvalidRequest("all", "must be true when set")
        if target == "request_id":
            admission.check_request_id(request.request_id, self.config.limits)
        admission.check_id_length("instance_id", request.instance_id, self.config.limits)
        if request.instance_id and request.instance_id != self.instance_id:
            return pb.AbortResponse(outcome=pb.ABORT_OUTCOME_NOT_FOUND)
        if target == "all":
            count = await self.registry.abort_all()
            metrics.ABORT_RPC.inc(count)
            outcome = pb.ABORT_OUTCOME_ABORTED if count else pb.ABORT_OUTCOME_NOT_FOUND
            return pb.AbortResponse(outcome=outcome, aborted_count=count)
        result = await self.registry.abort(request.request_id)
        if result is AbortOutcome.ABORTED:
            metrics.ABORT_RPC.inc()
        return pb.AbortResponse(
            outcome=ABORT_OUTCOMES[result],
            aborted_count=1 if result is AbortOutcome.ABORTED else 0,
        )

    async def reset_prefix_cache(self) -> bool:
        self.serving()
        try:
            return await self.backend.reset_prefix_cache()
        except EngineDeadError as e:
            raise EngineUnavailable(f"engine died: {e}") from e

    def _nothing_generated(
        self, plan: admission.Plan, reason: pb.FinishReason, arrived: float
    ) -> pb.GenerateResponse:
        usage = _usage(plan, None, 0)
        metrics.GENERATE.finished(arrived, None, reason, usage)
        return pb.GenerateResponse(
            finished=pb.GenerateFinished(
                finish_reason=reason, usage=usage, instance_id=self.instance_id
            )
        )

    def load(self) -> pb.GetLoadResponse:
        response = pb.GetLoadResponse(
            registered_requests=len(self.registry), refit_state=self.refit.state()
        )
        if self._serving is not None:
            load = self.backend.load()
            response.running_requests = load.running
            response.waiting_requests = load.waiting
            response.kv_blocks_used = load.kv_blocks_used
            response.kv_blocks_total = load.kv_blocks_total
        return response

    # -- the engine's outputs for one request ---------------------------------

    async def _outputs(
        self, plan: admission.Plan, entry: ActiveRequest
    ) -> AsyncGenerator[EngineOutput, None]:
        """The backend's outputs for one request; the engine request never outlives this."""
        request_id = plan.request_id
        finished = False
        stream = self.backend.generate(request_id, plan.prompt_token_ids, plan.spec)
        try:
            async for out in stream:
                if out.finished:
                    finished = True
                    if out.finish_reason is FinishReason.ABORTED:
                        entry.raise_if_ended()  # a shutdown's or a pause's: retryable
                elif entry.abort_requested or entry.weights_changed:
                    # An abort that raced the engine's admission of the request
                    # found nothing to abort; repeat it now that the engine has it.
                    await self.backend.abort(request_id)
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
                await self.backend.abort(request_id)
        if not finished:
            raise EngineFailed("engine ended the request without a final output")

    def _finish(
        self,
        finished: pb.GenerateFinished | pb.RolloutResponse,
        plan: admission.Plan,
        out: EngineOutput,
        completion: int,
        entry: ActiveRequest,
    ) -> None:
        """The fields a last Generate message and a Rollout answer share."""
        reason = out.finish_reason or FinishReason.ERROR
        finished.finish_reason = codec.FINISH_REASONS[reason]
        if reason is FinishReason.ABORTED and entry.weights_changed:
            finished.finish_reason = pb.FINISH_REASON_WEIGHT_VERSION_CHANGED
        match = codec.stop_match(out.stop_reason) if reason is FinishReason.STOP else None
        if match is not None:
            finished.matched_stop.CopyFrom(match)
        finished.usage.CopyFrom(_usage(plan, out, completion))
        finished.instance_id = self.instance_id
        spans = out.weight_versions
        required = plan.required_weight_version
        if spans is None and completion:
            # The engine keeps no spans: its current label, or the one a guarded
            # request required (checked at its start; a change would have ended it).
            spans = [(required or self.refit.version, 0, completion)]
        other = next((v for v, _, _ in spans or () if v != required), None)
        if required is not None and other is not None:
            # The engine's label changed past this server's refit control (a host
            # that drives its engine itself): nothing of another version goes out.
            raise WeightVersionMismatch(required, other, engine_changed=True)
        for version, start, end in spans or ():
            finished.weight_versions.add(version=version, start=start, end=end)
        if plan.spec.return_routed_experts and out.routed_experts is not None:
            finished.routed_experts.CopyFrom(codec.routed_experts(out.routed_experts))


def _usage(plan: admission.Plan, last: EngineOutput | None, completion: int) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(plan.prompt_token_ids),
        completion_tokens=completion,
        cached_prompt_tokens=last.num_cached_tokens if last is not None else 0,
    )
