"""The weight-transfer phases (vLLM's init, start, update, finish, shutdown) as a state
machine, apart from the refit rules that call them.

Apart because what a phase leaves behind is a state of its own, with its own
transitions, whatever the rules around it (``RefitControl`` holds the lock, the
pause, the fence and the version, and calls in here under its lock). Two things
make up the state:

- **the trainer's update** (``update``): none, or open (``OpenUpdate``) from a
  StartWeightUpdate that succeeded until its FinishWeightUpdate, whatever that
  answers. It closes early when the engine ends it (rolled back: ``UpdateAbandoned``;
  or, while loading, not: the weights unknown), when a step that loads runs past its
  deadline, when a teardown runs, and when a new init or a shutdown finds an update
  its trainer left part way and the engine rolls it back (``abandon``).
- **whether the weights are whole** (``mixed_weights``): once an UpdateWeights
  round has gone to the engine, the weights are neither the old ones nor the new
  until the update finishes, and an update that ends otherwise, not rolled back
  (an engine without ``abort_weight_update``: vLLM's NCCL one; a finish whose
  caller left before the label was set), leaves them so (``mixed``) until whole
  weights land (``whole``, from ``RefitControl.finish_update``); so does the
  finish of an update orphaned meanwhile (its group released or replaced while it
  was open: vLLM 0.32's own engines refuse the release during an update).
  Meanwhile the label does not say what serves: no version-guarded request is
  served, and a paused server does not resume. Each step records what it did
  itself, in the task that runs to its end whether or not its caller stays.
- **the engine's lane** (``stuck``): free, or held by a step given up on at its
  deadline that still runs in the engine (``StuckStep``), with any teardown queued
  behind it there. While held, a new init (or a shutdown none is queued for) is
  refused at once instead of queueing behind it (the engine runs its calls in
  turn); the lane frees itself once both have ended.

What a step's deadline leaves depends on what the step does (``Step``): one that
sets the transfer engine up has it torn down, nothing loaded; one that loads leaves
the weights unknown; a teardown leaves no update in progress.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine_contract import refit_rules
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import EngineBackend
from engine_server.backends.refit import RefitUnsupported, WeightUpdateError
from engine_server.config import RefitConfig
from engine_server.deadlines import Expired, to_the_end
from engine_server.errors import (
    EngineFailed,
    RefitRefused,
    RefitTimedOut,
    TransferUnavailable,
    UpdateAbandoned,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a setup step given up on at its deadline waits for the teardown sent
# after it while the step still runs in the engine (the teardown queues behind it).
_TEARDOWN_GLANCE_S = 1.0


class Step(enum.Enum):
    """What a phase does, for what its deadline leaves."""

    SETUP = "setup"  # init, start: torn down past the deadline; nothing loaded
    LOADING = "loading"  # update: past the deadline the weights are unknown
    TEARDOWN = "teardown"  # shutdown: past the deadline no update is left in progress


@dataclass
class OpenUpdate:
    """An update between StartWeightUpdate and FinishWeightUpdate."""

    options: pb.WeightUpdateOptions
    reset: bool  # whether the prefix cache is reset once it finished
    started: float  # time.monotonic() when it started
    # UpdateWeights rounds sent to the engine: each may have loaded, whatever its
    # caller saw (one refused before the engine saw it is taken back).
    rounds: int = 0
    # Why its trainer's group was replaced or released while it was open, on an
    # engine that cannot roll it back: its rounds and any later ones are no one
    # update, so its finish ends it without a label (``drop``). None: not so.
    orphaned: str | None = None


@dataclass(frozen=True)
class StuckStep:
    """A step given up on at its deadline that still runs in the engine."""

    phase: str
    since: float  # time.monotonic() when it was given up on
    ended: asyncio.Future[Any]  # done once it (and any teardown behind it) ended
    teardown_queued: bool  # a shutdown is queued in the engine behind it


def _teardown_ended(task: asyncio.Future[Any]) -> None:
    """The teardown after a setup step given up on: its failure is only logged (the
    setup's error is the answer)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("shutting the weight-transfer engine down failed: %r", task.exception())


class TransferPhases:
    """The phases' state (the trainer's ``update``, the engine's ``stuck`` lane) and
    the steps that move it. Called under the refit lock only.

    ``on_break``: the refit control's own way to say the weights are unknown from
    now (it stops serving); returns the error to answer with."""

    def __init__(
        self,
        backend: EngineBackend,
        config: RefitConfig,
        on_break: Callable[[str], EngineFailed],
    ) -> None:
        self._backend = backend
        self._config = config
        self._break = on_break
        self.update: OpenUpdate | None = None
        self.stuck: StuckStep | None = None
        # Why the weights are part old, part new: an update ended after its rounds
        # reached the engine, neither finished nor rolled back. None: whole.
        self.mixed: str | None = None

    # -- the trainer's update ---------------------------------------------------

    def started(self) -> OpenUpdate:
        """The update in progress; refused when none was started."""
        if self.update is None:
            raise RefitRefused(refit_rules.PhaseRefusal.NOT_STARTED.value)
        return self.update

    def refuse_if_started(self) -> None:
        if self.update is not None:
            raise RefitRefused(refit_rules.PhaseRefusal.ALREADY_STARTED.value)

    def refuse_a_load_beside(self) -> None:
        """A checkpoint or tensor load while an update is open would land between its
        trainer's rounds, and its finish would label both: its trainer ends it first."""
        if self.update is not None:
            raise RefitRefused(
                f"{refit_rules.UPDATE_OPEN} ({self.update.rounds} UpdateWeights round(s) "
                "sent since StartWeightUpdate): a load now would land between its writer's "
                f"rounds; {refit_rules.UPDATE_WAYS_OUT}"
            )

    def close(self) -> None:
        """The update finished: the engine holds its weights whole."""
        self.update = None

    def drop(self, how: str | None) -> None:
        """The update is over without its finish, not rolled back (``how``: the way
        it ended, after the way it was orphaned if it was; None: that way alone):
        whatever its rounds loaded stays in the engine."""
        update, self.update = self.update, None
        if update is None or not update.rounds:
            return
        how = ", then ".join(r for r in (update.orphaned, how) if r) or "without a reason"
        self.mixed = (
            f"a weight-transfer update ended unfinished ({how}) after {update.rounds} "
            "UpdateWeights round(s) reached the engine, which did not roll them back; the "
            "weights are part old, part new, or new under the old label"
        )
        log.warning("%s", self.mixed)

    def whole(self) -> None:
        """Whole weights landed (an update that named every tensor): mixed no more."""
        self.mixed = None

    def mixed_weights(self) -> str | None:
        """Why the weights serving are not the ones their label names, or None."""
        if self.update is not None and self.update.rounds:
            return (
                f"a weight-transfer update is part way, {self.update.rounds} UpdateWeights "
                "round(s) sent since StartWeightUpdate and no FinishWeightUpdate yet"
            )
        return self.mixed

    # -- the phases ---------------------------------------------------------------

    async def init(self, info: dict[str, Any], limit: float, deadline: str) -> None:
        """A (new) transfer engine: an update its trainer left is rolled back first."""
        self._refuse_if_stuck()
        await self.abandon("a new InitWeightTransferEngine replaces the trainer's group")
        await self.run(
            self._backend.init_weight_transfer(info),
            "InitWeightTransferEngine",
            Step.SETUP,
            limit=limit,
            deadline=deadline,
        )

    async def start(
        self, step: Awaitable[None], options: pb.WeightUpdateOptions, reset: bool
    ) -> None:
        """The engine's start (``step``), then the update is open."""
        await self.run(step, "StartWeightUpdate", Step.SETUP)
        self.update = OpenUpdate(options, reset, time.monotonic())

    async def load_round(self, step: Awaitable[None]) -> None:
        """One UpdateWeights round (``step``) of the update in progress, counted as
        sent before it goes (its caller may leave while the engine loads it)."""
        update = self.started()
        update.rounds += 1

        async def counted() -> None:  # in the step's task: its caller may be gone
            try:
                await step
            except WeightUpdateError:  # refused before the engine saw it
                update.rounds -= 1
                raise

        await self.run(counted(), "UpdateWeights", Step.LOADING)

    async def shut_down(self) -> None:
        """The transfer engine released: an update its trainer left is rolled back
        first; one queued behind a stuck step already is not sent again."""
        stuck = self.stuck
        if stuck is not None and stuck.teardown_queued and not stuck.ended.done():
            log.info("weight-transfer shutdown: already queued behind %s", stuck.phase)
            self.drop("ShutdownWeightTransferEngine")
            return
        self._refuse_if_stuck()
        await self.abandon("ShutdownWeightTransferEngine releases the trainer's group")

        update = self.update  # orphaned by the abandon above (or earlier), if any

        async def released() -> None:  # in the step's task: its caller may be gone
            await self._backend.shutdown_weight_transfer()
            if self.update is update:  # not one started since (after a deadline)
                self.drop(None)

        await self.run(released(), "ShutdownWeightTransferEngine", Step.TEARDOWN)

    def _refuse_if_stuck(self) -> None:
        """UNAVAILABLE at once, for a new init (or a shutdown none is queued for), while
        a step given up on still runs in the engine: a call sent there now would only
        queue behind it (vLLM runs them in turn)."""
        if self.stuck is None:
            return
        if self.stuck.ended.done():
            self.stuck = None
            return
        raise TransferUnavailable(
            f"a previous weight-transfer call ({self.stuck.phase}) is still stuck in the "
            f"engine: given up on at its deadline {time.monotonic() - self.stuck.since:.0f} s "
            "ago, it has not ended (a gloo rendezvous gives up by itself within about twice "
            "its timeout_s); the weight-transfer engine is shut down once it ends: try again "
            "then; the old weights still serve"
        )

    async def abandon(self, why: str) -> None:
        """An update its trainer left part way (started, never finished: a trainer
        gone between its calls) rolled back before the transfer engine is replaced
        or released, so the old weights serve again and the lock's next holder
        finds no update in progress. An engine that cannot roll back keeps the
        update in progress, marked ``orphaned`` (its finish, if any, ends it
        unlabelled); one that fails to leaves the weights unknown. The outcome is
        recorded by the step itself, which runs to its end even when the caller
        leaves (``to_the_end``)."""
        update = self.update
        if update is None:
            return
        limit = self._config.timeout_s
        try:
            await to_the_end(self._roll_back(update, why), limit)
        except RefitUnsupported:
            return
        except Expired:
            self.update = None
            raise self._break(
                f"rolling back the weight update in progress ({why}) did not end within "
                f"the refit deadline of {limit:g} s (--refit-timeout-s)"
            ) from None

    async def _roll_back(self, update: OpenUpdate, why: str) -> None:
        try:
            await self._backend.abort_weight_update(why)
        except RefitUnsupported:
            if update.orphaned is None:  # the first way it was orphaned
                update.orphaned = (
                    f"a release or replacement of its trainer's group was asked while it "
                    f"was open ({why})"
                )
            raise
        except Exception as e:
            if self.update is not update:  # given up on at the deadline: broken already
                raise
            self.update = None
            if isinstance(e, EngineFailed):  # the engine's account of what it could not undo
                raise self._break(str(e)) from e
            raise self._break(
                f"rolling back the weight update in progress ({why}) failed ({clip(e, 300)})"
            ) from e
        if self.update is update:  # not one started since (after a deadline)
            self.update = None
        log.warning(
            "the weight update in progress was abandoned (%s) and rolled back: the old "
            "weights serve",
            why,
        )

    # -- one step, bounded ------------------------------------------------------------

    async def _ended(self, step: Awaitable[T], kind: Step) -> T:
        """``step``, and what its end means for the update in progress, recorded even
        when its caller is gone meanwhile (a trainer killed during its UpdateWeights):
        an update the engine rolled back is over; one it could not roll back leaves
        the weights unknown."""
        try:
            return await step
        except UpdateAbandoned:
            self.update = None
            raise
        except EngineFailed as e:
            if kind is not Step.LOADING:
                raise
            self.update = None
            raise self._break(str(e)) from e

    async def run(
        self,
        step: Awaitable[T],
        phase: str,
        kind: Step,
        *,
        limit: float | None = None,
        deadline: str | None = None,
    ) -> T:
        """One phase, bounded by the refit deadline (or ``limit``, described by
        ``deadline``). Past it: a setup has the transfer engine torn down, a load
        leaves the weights unknown; the lock is released."""
        if limit is None:
            limit = self._config.timeout_s
            deadline = f"the refit deadline of {limit:g} s (--refit-timeout-s)"
        task = asyncio.ensure_future(self._ended(step, kind))
        try:
            return await to_the_end(task, limit)
        except RefitUnsupported as e:
            raise RefitRefused(str(e)) from e
        except Expired:
            late = f"{phase} did not end within {deadline}"
            if kind is Step.LOADING:
                self.update = None
                self.stuck = StuckStep(phase, time.monotonic(), task, False)
                raise self._break(late) from None
            if kind is Step.SETUP:
                late += await self._tear_down(task, phase)
            else:  # the teardown itself: whatever it left, no update is in progress
                self.drop(f"{phase} given up on at its deadline")
                self.stuck = StuckStep(phase, time.monotonic(), task, True)
            mixed = self.mixed_weights()
            if mixed is not None:
                raise RefitTimedOut(f"{late}; it loaded nothing, but {mixed}") from None
            raise RefitTimedOut(
                f"{late}; nothing was loaded, the old weights still serve"
            ) from None

    async def _tear_down(self, stuck: asyncio.Future[Any], phase: str) -> str:
        """Best effort, bounded by the check deadline: tearing down is not loading.
        While the step given up on (``stuck``) still runs in the engine, the
        teardown queues behind it there: it is sent, waited for briefly, and left
        to end in the background, transfer calls being refused until both have
        ended (``stuck``) instead of queueing behind them. What to add to the answer."""
        teardown = asyncio.ensure_future(self._backend.shutdown_weight_transfer())
        teardown.add_done_callback(_teardown_ended)
        limit = self._config.check_timeout_s
        if not stuck.done():
            limit = min(limit, _TEARDOWN_GLANCE_S)
        try:
            await asyncio.wait({teardown}, timeout=limit)
        finally:
            if not (stuck.done() and teardown.done()):
                ended = asyncio.gather(stuck, teardown, return_exceptions=True)
                self.stuck = StuckStep(phase, time.monotonic(), ended, True)
        if teardown.done():
            return "; the weight-transfer engine was shut down (best effort)"
        return (
            "; the weight-transfer engine is shut down once the engine ends that call "
            "(it is still running there)"
        )
