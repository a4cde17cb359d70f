"""The fleet refit cycle, whatever carries its calls: every worker on the new
weights, or none.

A step is all or nothing across the fleet (docs/refit.md, "Refit across a
fleet"), so that rollouts never mix two policies: pause every worker, load the
new weights on all at once, and only once every load succeeded label them with
the version, publish it (``store``: ``rl_client.committed``) and resume.
Otherwise every worker that was sent the weights goes back to the fleet's
committed ones (the checkpoint reloaded, or the trainer's previous tensors sent
again) under its old version, and resumes; one that cannot go back is taken out
of the router's pool (asleep: health NOT_SERVING, which its bridge follows)
rather than serve a third version. ``RefitError`` carries the report: each
worker's outcome, its timings, and why.

Here once, so that both ways in (``rl_client.refit``: ``RefitClient`` over the
RL routes, ``EngineRefitClient`` over the contract) follow the same rules: each
is a ``_Cycle`` that says how to pause, load, label, resume, probe and sleep one
worker. No Dynamo import here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc

from engine_contract.labels import label_problem
from engine_contract.refit_rules import pause_mode
from rl_client.committed import (
    CommittedRecord,
    CommittedStore,
    CommittedWeights,
    WeightSource,
)

__all__ = [
    "Deadlines",
    "Health",
    "Outcome",
    "RefitError",
    "RefitReport",
    "WorkerRefit",
]


class Outcome(enum.Enum):
    """Where a worker ended after a fleet refit."""

    UPDATED = "updated"
    ROLLED_BACK = "rolled back"
    # Never sent the new weights: the refit stopped at the pause.
    UNCHANGED = "unchanged"
    # Could not be brought back, nor taken out of the pool: paused, serving nothing.
    ROLLBACK_FAILED = "failed to roll back"
    # Could not be brought back; out of the router's pool (asleep, or its engine
    # server not serving or not answering, which its bridge follows).
    REMOVED = "removed"


class Health(enum.Enum):
    """A worker's engine as its bridge sees it: anything but SERVING takes the worker
    out of the router's pool (``bridge/engine_watch.py``)."""

    SERVING = "serving"
    NOT_SERVING = "not serving"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Deadlines:
    """How long one worker may take per step, in seconds (None: no limit).

    Past it the call is cancelled and the worker counts as failed. Its engine may
    still finish the step (an engine server never stops a load half way), which
    is why such a worker is sent the rollback too: the engine server runs it
    after, under its refit lock. Loads have no limit by default (a large
    checkpoint loads for its time, a WAIT pause lasts until the rollouts in
    flight end); labelling, resuming, health and sleep get ``control_s``."""

    pause_s: float | None = None
    update_s: float | None = None
    rollback_s: float | None = None
    control_s: float | None = 30.0


_STAGES = ("pause", "update", "label", "rollback", "resume")


@dataclass
class WorkerRefit:
    """What one worker did in one fleet refit."""

    worker: str
    outcome: Outcome = Outcome.UNCHANGED
    # The version it serves after the step (None: removed, or not known).
    version: str | None = None
    pause_s: float = 0.0
    update_s: float = 0.0
    label_s: float = 0.0
    rollback_s: float = 0.0  # the rollback, and taking the worker out when it failed
    resume_s: float = 0.0
    resumed: bool = False
    # Its first failure and where: "pause", "update", "label" or "resume".
    error: str | None = None
    stage: str = ""
    # Why it could not be brought back to the committed weights.
    rollback_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.rollback_error is None

    def _failed(self, stage: str, message: str) -> None:
        if stage == "rollback":
            self.rollback_error = message
        elif self.error is None:
            self.error, self.stage = message, stage

    def describe(self) -> str:
        took = ", ".join(
            f"{stage} {getattr(self, f'{stage}_s'):.3f} s"
            for stage in _STAGES
            if getattr(self, f"{stage}_s")
        )
        line = (
            f"{self.worker}: {self.outcome.value}, serving {self.version!r} ({took or 'no call'})"
        )
        if self.error is not None:
            line += f"; {self.stage} failed: {self.error}"
        if self.rollback_error is not None:
            line += f"; rollback failed: {self.rollback_error}"
        return line


@dataclass
class RefitReport:
    """One fleet refit: ``committed`` when every worker took ``version``; otherwise
    every worker went back to ``previous`` (or out of the pool, says its outcome)."""

    version: str
    workers: list[WorkerRefit] = field(default_factory=list)
    seconds: float = 0.0
    previous: str | None = None
    committed: bool = False
    # Why the record could not be written to the store (the refit then failed).
    publish_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.committed and all(w.resumed for w in self.workers)

    @property
    def failed(self) -> list[WorkerRefit]:
        return [w for w in self.workers if not w.ok]

    def outcomes(self) -> dict[str, Outcome]:
        return {w.worker: w.outcome for w in self.workers}

    def describe(self) -> str:
        return "\n".join(f"  {w.describe()}" for w in self.workers)


class RefitError(RuntimeError):
    """The refit did not commit on every worker (or some did not resume after it
    committed); ``report`` has every worker's outcome, timings and error."""

    def __init__(self, report: RefitReport) -> None:
        n, total = len(report.failed), len(report.workers)
        if report.committed:
            head = f"refit to {report.version!r} committed, but {n} of {total} workers failed"
        else:
            head = (
                f"refit to {report.version!r} failed, so no worker serves it (back on "
                f"{report.previous!r}); {n} of {total} workers failed"
            )
        why = [f"{w.worker} ({w.stage}): {w.error}" for w in report.workers if w.error]
        if report.publish_error is not None:
            why.append(f"publishing the committed version: {report.publish_error}")
        super().__init__(f"{head}: {'; '.join(why)}\n{report.describe()}")
        self.report = report


class _Unanswered(Exception):
    """Some workers did not say what they serve before the refit (nothing was sent)."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{w}: {e}" for w, e in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class _Previous:
    """What one worker goes back to when the refit fails."""

    version: str
    source: WeightSource


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__


async def _each(
    entries: Iterable[WorkerRefit],
    stage: str,
    limit: float | None,
    step: Callable[[WorkerRefit], Awaitable[None]],
) -> None:
    """Run ``step`` on every entry at once, each within ``limit``; its time and any
    failure are written into the entry."""

    async def guarded(entry: WorkerRefit) -> None:
        started = time.monotonic()
        timer = asyncio.timeout(limit)
        try:
            async with timer:
                await step(entry)
        except TimeoutError as e:
            if timer.expired():
                entry._failed(stage, f"did not answer within its {stage} deadline of {limit:g} s")
            else:
                entry._failed(stage, _why(e))
        except Exception as e:
            entry._failed(stage, _why(e))
        finally:
            elapsed = time.monotonic() - started
            setattr(entry, f"{stage}_s", getattr(entry, f"{stage}_s") + elapsed)

    await asyncio.gather(*(guarded(e) for e in entries))


class _Cycle(ABC):
    """The fleet refit's choreography, whatever carries the calls."""

    def __init__(
        self,
        committed: CommittedWeights | None,
        store: CommittedStore | None,
        deadlines: Deadlines | None,
    ) -> None:
        # What the whole fleet serves: what a failed refit goes back to. Learnt
        # from each committed refit; None: from the store, else the start state.
        self.committed = committed
        self.store = store
        self.deadlines = deadlines or Deadlines()
        self._one_at_a_time = asyncio.Lock()

    # -- what each transport does -------------------------------------------

    @abstractmethod
    def _fleet(self) -> list[str]: ...

    @abstractmethod
    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None: ...

    @abstractmethod
    async def _resume(self, worker: str) -> None: ...

    @abstractmethod
    async def _load(self, worker: str, source: WeightSource) -> None:
        """Load ``source``'s weights, the version label left as it is."""

    @abstractmethod
    async def _label(self, worker: str, version: str) -> None: ...

    @abstractmethod
    async def _health(self, worker: str) -> Health: ...

    @abstractmethod
    async def _sleep(self, worker: str) -> None:
        """Out of the router's pool: asleep, its engine server says NOT_SERVING."""

    @abstractmethod
    def _loads(self, source: WeightSource) -> bool:
        """Whether this transport can load ``source``'s weights."""

    @abstractmethod
    async def _start_state(self) -> dict[str, _Previous]:
        """What each worker was started on, when no refit is known to have
        changed it; ValueError when that cannot be known, ``_Unanswered`` naming
        the workers that did not say."""

    # -- the cycle --------------------------------------------------------------

    async def _plan(self) -> dict[str, _Previous]:
        """What each worker goes back to if the refit fails, known before any call:
        the fleet's committed weights (this client's last refit, ``committed=``,
        or the store's record), else what the workers were started on."""
        committed = self.committed
        if committed is None and self.store is not None:
            record = await asyncio.to_thread(self.store.read)
            committed = record.weights if record is not None else None
        if committed is None:
            return await self._start_state()
        if not committed.resendable or not self._loads(committed.source):
            raise ValueError(
                f"the fleet serves {committed.version!r} ({committed.source}), which this "
                "client cannot load again, so it could not undo a failed refit: give "
                "committed= with weights it can load (a CheckpointSource, or PushedSource "
                "with the tensors)"
            )
        return {w: _Previous(committed.version, committed.source) for w in self._fleet()}

    async def _run(
        self, version: str, source: WeightSource, mode: str, clear_cache: bool
    ) -> RefitReport:
        pause_mode(mode)  # ValueError naming the modes, before any call
        problem = label_problem(version)
        if problem is not None:
            raise ValueError(f"version {version!r}: {problem}")
        async with self._one_at_a_time:
            started = time.monotonic()
            try:
                plan = await self._plan()
            except _Unanswered as e:  # stopped before the pause: nothing changed
                report = RefitReport(version, [WorkerRefit(w) for w in self._fleet()])
                for entry in report.workers:
                    if entry.worker in e.errors:
                        entry._failed("pause", e.errors[entry.worker])
                report.seconds = time.monotonic() - started
                raise RefitError(report) from None
            previous = {p.version for p in plan.values()}
            report = RefitReport(
                version,
                [WorkerRefit(w, version=plan[w].version) for w in self._fleet()],
                previous=previous.pop() if len(previous) == 1 else None,
            )
            await self._commit_or_roll_back(report, source, plan, mode, clear_cache)
            staying = [
                w
                for w in report.workers
                if w.outcome not in (Outcome.REMOVED, Outcome.ROLLBACK_FAILED)
            ]

            async def resume(entry: WorkerRefit) -> None:
                await self._resume(entry.worker)
                entry.resumed = True

            await _each(staying, "resume", self.deadlines.control_s, resume)
            report.seconds = time.monotonic() - started
        if not report.ok:
            raise RefitError(report)
        return report

    async def _commit_or_roll_back(
        self,
        report: RefitReport,
        source: WeightSource,
        plan: dict[str, _Previous],
        mode: str,
        clear_cache: bool,
    ) -> None:
        entries, limits = report.workers, self.deadlines

        def all_ok() -> bool:
            return all(w.ok for w in entries)

        async def pause(entry: WorkerRefit) -> None:
            await self._pause(entry.worker, mode, clear_cache)

        async def load(entry: WorkerRefit) -> None:
            await self._load(entry.worker, source)

        async def label(entry: WorkerRefit) -> None:
            await self._label(entry.worker, report.version)

        await _each(entries, "pause", limits.pause_s, pause)
        if not all_ok():  # nothing was sent: every worker keeps its weights
            return
        await _each(entries, "update", limits.update_s, load)
        labelled = all_ok()
        if labelled:
            await _each(entries, "label", limits.control_s, label)
        weights = CommittedWeights(report.version, source)
        published = False
        if all_ok():
            published = await self._publish(report, weights)
            if published:
                report.committed = True
                self.committed = weights
                for entry in entries:
                    entry.outcome, entry.version = Outcome.UPDATED, report.version
                return
        await self._roll_back(entries, plan, relabel=labelled)

    async def _publish(self, report: RefitReport, weights: CommittedWeights) -> bool:
        """The commit point: the record says the new version, or the refit fails
        (the record then holds what it held before)."""
        store = self.store
        if store is None:
            return True
        try:
            before = await asyncio.to_thread(store.read)
        except ValueError:
            before = None  # an unreadable record: replaced, or removed on failure
        except Exception as e:
            report.publish_error = f"reading the record before writing it: {_why(e)}"
            return False
        record = CommittedRecord.now(weights, self._fleet())
        try:
            await asyncio.to_thread(store.publish, record)
            return True
        except Exception as e:
            report.publish_error = _why(e)
        try:  # it may have been written all the same: put back what was there
            if before is None:
                await asyncio.to_thread(store.delete)
            else:
                await asyncio.to_thread(store.publish, before)
        except Exception as e:
            report.publish_error += f"; restoring the previous record failed too: {_why(e)}"
        return False

    async def _roll_back(
        self, entries: list[WorkerRefit], plan: dict[str, _Previous], *, relabel: bool
    ) -> None:
        """Every worker back to the committed weights under its old version; one that
        cannot go back leaves the router's pool."""

        async def back(entry: WorkerRefit) -> None:
            previous = plan[entry.worker]
            await self._load(entry.worker, previous.source)
            if relabel:
                await self._label(entry.worker, previous.version)

        await _each(entries, "rollback", self.deadlines.rollback_s, back)
        for entry in entries:
            if entry.rollback_error is None:
                entry.outcome = Outcome.ROLLED_BACK
                entry.version = plan[entry.worker].version
        await asyncio.gather(*(self._remove(e) for e in entries if e.rollback_error is not None))

    async def _remove(self, entry: WorkerRefit) -> None:
        """Out of the pool a worker that could not be brought back: its engine
        server already says NOT_SERVING (its weights unknown) or does not answer, or
        it is put to sleep now; the bridge follows its health and leaves."""
        started = time.monotonic()
        limit = self.deadlines.control_s
        try:
            async with asyncio.timeout(limit):
                health = await self._health(entry.worker)
        except Exception:
            health = Health.UNREACHABLE
        if health is Health.SERVING:
            try:
                async with asyncio.timeout(limit):
                    await self._sleep(entry.worker)
                health = Health.NOT_SERVING
            except Exception as e:
                message = (
                    f"did not go to sleep within {limit:g} s"
                    if isinstance(e, TimeoutError)
                    else _why(e)
                )
                entry.rollback_error = f"{entry.rollback_error}; taking it out failed: {message}"
        entry.rollback_s += time.monotonic() - started
        entry.version = None
        if health is Health.SERVING:
            entry.outcome = Outcome.ROLLBACK_FAILED
        else:
            entry.outcome = Outcome.REMOVED
            entry.rollback_error = f"{entry.rollback_error}; out of the pool ({health.value})"
