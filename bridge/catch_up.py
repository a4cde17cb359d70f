"""Catch-up before serving: a worker takes traffic only on the fleet's committed weights.

An engine server that starts or restarts mid-training serves the checkpoint it
was started on (label "default"), not what the fleet moved on to. The trainer
publishes the fleet's committed weights in Dynamo's discovery store
(``rl_client.committed``); before the worker registers with Dynamo, and again
after every engine server restart, the bridge reads that record and decides
(``decide``):

- no record (no fleet refit committed yet, or catch-up off): register as ever;
- the engine serves the committed version already, whole: register;
- a weight-transfer update is open on the engine (contract revision 12), and
  the engine is not on the committed version whole: stay out of discovery until
  its writer ends it, then decide again;
- the committed weights are a checkpoint: the bridge loads it itself
  (``UpdateWeightsFromPath`` labelled with the committed version), resumes the
  engine, then registers;
- they were pushed by the trainer (streamed, nowhere on disk): the bridge stays
  out of discovery until the trainer's keeper (``rl_client.keeper``) has pushed
  them, watching the engine's version with a bounded poll.

Every step is re-decided from a fresh read of the record and of the engine's
state, so a refit that commits meanwhile, or an engine that restarts again,
is followed; failures (a store that does not answer, a record this bridge
cannot read, a load refused) are retried with a backoff, the worker staying
out of the pool meanwhile: it never serves weights it cannot vouch for.

No Dynamo, vllm or torch import: the link (``bridge.engine_link``) owns the
worker's place in discovery; this module only says when it may take it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from bridge import metrics
from engine_contract.refit_rules import UPDATE_WAYS_OUT
from engine_contract.v1 import engine_pb2 as pb
from rl_client.committed import (
    CHECKPOINT,
    PUSHED,
    CheckpointSource,
    CommittedRecord,
    CommittedStore,
    CommittedWeights,
    committed_store,
)

log = logging.getLogger(__name__)

# The engine's version is polled while the trainer's push is awaited: soon after
# it lands, never more often than this needs.
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.5
# After a failure (store, engine, load): retried, less and less often.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
# How often a long wait says it is still waiting.
STILL_WAITING_EVERY_S = 30.0


def committed_store_for(
    namespace: str, component: str, discovery_backend: str
) -> CommittedStore | None:
    """Where the trainer publishes this worker's committed weights: the discovery
    store the worker registers in (etcd, or Dynamo's files). None, with a warning,
    for a backend that keeps no such record (no trainer can publish one there)."""
    try:
        return committed_store(
            namespace,
            component,
            env={**os.environ, "DYN_DISCOVERY_BACKEND": discovery_backend},
        )
    except ValueError as e:
        log.warning("catch-up before serving is off: %s", e)
        return None


class Action(enum.Enum):
    """What the gate does with the worker now."""

    # No committed record: the worker registers as it always did.
    REGISTER = "register"
    # The engine serves the committed version: register (resuming it if we loaded).
    CURRENT = "current"
    # A committed checkpoint the engine lacks: the bridge loads it.
    LOAD = "load"
    # Weights pushed by the trainer, or an engine asleep: wait for someone else.
    WAIT = "wait"


@dataclass(frozen=True)
class Decision:
    action: Action
    committed: CommittedWeights | None
    why: str


def decide(record: CommittedRecord | None, state: pb.RefitState) -> Decision:
    """The gate's decision for an engine in ``state`` given the fleet's ``record``."""
    if record is None:
        return Decision(Action.REGISTER, None, "no committed weights are published")
    weights = record.weights
    # Not whole: an update is part way, or one ended unfinished, not rolled back.
    whole = not state.weights_mixed
    # An initial label is the engine's start checkpoint, whatever it reads.
    if whole and state.weight_version_declared and state.weight_version == weights.version:
        return Decision(Action.CURRENT, weights, f"the engine serves {weights.version!r}")
    if state.weight_update_open:
        # The engine refuses a load under it (it would land between its writer's
        # rounds), and would not resume until it ends.
        return Decision(
            Action.WAIT,
            weights,
            f"a weight-transfer update is open on the engine "
            f"({state.weights_mixed or 'no UpdateWeights round sent yet'}): waiting for its "
            f"writer; {UPDATE_WAYS_OUT}",
        )
    serving = repr(state.weight_version) + ("" if state.weight_version_declared else " (initial)")
    if not whole:
        serving += f", not whole ({state.weights_mixed})"
    if state.sleeping:
        return Decision(
            Action.WAIT,
            weights,
            f"the engine is asleep on {serving}; whoever put it to sleep wakes it",
        )
    if isinstance(weights.source, CheckpointSource):
        return Decision(
            Action.LOAD,
            weights,
            f"the engine serves {serving}; the fleet committed {weights.version!r} "
            f"(checkpoint {weights.source.path})",
        )
    return Decision(
        Action.WAIT,
        weights,
        f"the engine serves {serving}; the fleet committed {weights.version!r}, pushed by "
        "the trainer: waiting for its keeper to push them",
    )


class CatchUpOutcome(enum.Enum):
    """How a catch-up ended."""

    NO_RECORD = "no record"
    CURRENT = "already current"
    LOADED = "checkpoint loaded"
    PUSHED = "pushed by the trainer"


@dataclass(frozen=True)
class Result:
    outcome: CatchUpOutcome
    # The committed version and where its weights come from ("checkpoint",
    # "pushed"); None without a record.
    version: str | None
    source: str | None
    seconds: float


class EngineCalls(Protocol):
    """The contract calls the gate makes (``rl_client.refit_rpc.RefitRpc`` has them)."""

    async def server_info(
        self, request: pb.GetServerInfoRequest | None = None
    ) -> pb.GetServerInfoResponse: ...

    async def pause_generation(
        self, request: pb.PauseGenerationRequest
    ) -> pb.PauseGenerationResponse: ...

    async def update_weights_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse: ...

    async def resume_generation(
        self, request: pb.ResumeGenerationRequest | None = None
    ) -> pb.ResumeGenerationResponse: ...


class _Backoff:
    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._next = first_s

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 1.5, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.first_s


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__


class CatchUp:
    """The gate for one engine server (see the module docs). ``run()`` returns once
    the worker may be in the pool; cancel it to give up (a newer instance's
    catch-up replaces it). ``control_timeout_s`` bounds every call but the load,
    which takes a large checkpoint's time (the engine server bounds it:
    ``--refit-timeout-s``)."""

    def __init__(
        self,
        store: CommittedStore,
        engine: EngineCalls,
        *,
        control_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.engine = engine
        self.control_timeout_s = control_timeout_s

    async def run(self, on_hold: Callable[[str], Awaitable[None]] | None = None) -> Result:
        """Until the engine serves the committed weights (or none are published).
        ``on_hold(why)``: awaited once, before the first load or wait: the worker
        must leave the pool then."""
        started = time.monotonic()
        poll = _Backoff(POLL_FIRST_S, POLL_MAX_S)
        retry = _Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        loaded = waited = False
        # When each message was last logged. Not only the last one: a retry that
        # says two things (the load it tries, its failure) must not log both
        # again every time round.
        said: dict[str, float] = {}

        def say(level: int, message: str) -> None:
            """Once per distinct message, and then every STILL_WAITING_EVERY_S."""
            now = time.monotonic()
            last = said.get(message)
            if last is None or now - last >= STILL_WAITING_EVERY_S:
                waited_s = "" if last is None else f" ({now - started:.0f}s so far)"
                log.log(level, "catch-up: %s%s", message, waited_s)
                said[message] = now
                # Forget what was not said for a while (a failure's details vary).
                for old in [m for m, t in said.items() if now - t > 2 * STILL_WAITING_EVERY_S]:
                    del said[old]

        while True:
            try:
                record = await asyncio.to_thread(self.store.read)
                async with asyncio.timeout(self.control_timeout_s):
                    info = await self.engine.server_info()
            except Exception as e:  # a store or an engine that does not answer (yet)
                say(
                    logging.ERROR if isinstance(e, ValueError) else logging.WARNING,
                    f"cannot tell which weights to serve ({_why(e)}); out of the router's "
                    "pool, trying again",
                )
                await asyncio.sleep(retry.next())
                continue
            decision = decide(record, info.refit_state)
            if decision.action is Action.REGISTER:
                return Result(CatchUpOutcome.NO_RECORD, None, None, time.monotonic() - started)
            assert decision.committed is not None
            version = decision.committed.version
            kind = CHECKPOINT if isinstance(decision.committed.source, CheckpointSource) else PUSHED
            if decision.action in (Action.LOAD, Action.WAIT) and on_hold is not None:
                hold, on_hold = on_hold, None
                await hold(decision.why)
            if decision.action is Action.CURRENT:
                if loaded:
                    try:
                        async with asyncio.timeout(self.control_timeout_s):
                            await self.engine.resume_generation()
                    except Exception as e:
                        say(logging.WARNING, f"resuming the engine failed ({_why(e)}); again")
                        await asyncio.sleep(retry.next())
                        continue
                outcome = (
                    CatchUpOutcome.LOADED
                    if loaded
                    else CatchUpOutcome.PUSHED
                    if waited
                    else CatchUpOutcome.CURRENT
                )
                return Result(outcome, version, kind, time.monotonic() - started)
            if decision.action is Action.WAIT:
                waited = True
                say(logging.WARNING, f"{decision.why}; out of the router's pool until then")
                await asyncio.sleep(poll.next())
                continue
            source = decision.committed.source
            assert isinstance(source, CheckpointSource)
            say(logging.WARNING, f"{decision.why}: loading it before serving")
            try:
                await self._load(info.refit_state, source.path, version)
            except Exception as e:
                say(logging.ERROR, f"loading {source.path} as {version!r} failed: {_why(e)}")
                await asyncio.sleep(retry.next())
                continue
            loaded = True
            retry.reset()
            # Not done yet: decided again from a fresh read, so that a refit that
            # committed during the load is followed, not overwritten.

    async def _load(self, state: pb.RefitState, path: str, version: str) -> None:
        if not state.paused:
            # Requests running here run on weights the fleet left behind: end them
            # (migratable). The load resets the prefix cache.
            async with asyncio.timeout(self.control_timeout_s):
                await self.engine.pause_generation(
                    pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT, clear_cache=False)
                )
        # Fenced on the count read with the decision: a trainer's load or label in
        # between (a refit starting meanwhile) makes this one refused, and the
        # next round decides again from a fresh read (contract revision 10).
        options = pb.WeightUpdateOptions(
            weight_version=version, expect_weight_changes=state.weight_changes
        )
        await self.engine.update_weights_from_path(
            pb.UpdateWeightsFromPathRequest(path=path, options=options)
        )


def observe(result: Result) -> None:
    """The bridge's metric and log line for a finished catch-up."""
    if result.source is None:
        log.info("catch-up: no committed weights published: serving as started")
        return
    metrics.CATCH_UP_SECONDS.labels(result.source).observe(result.seconds)
    log.info(
        "catch-up: on the committed weights %r (%s) after %.3fs: serving",
        result.version,
        result.outcome.value,
        result.seconds,
    )
