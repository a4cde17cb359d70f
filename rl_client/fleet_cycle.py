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
rather than serve a third version. ``RefitError`` carries the report
(``rl_client.refit_report``): each worker's outcome, its timings, and why.

One writer at a time, and every pause undone. With a ``store``, a refit holds
the fleet's lease (``rl_client.fleet_lease``) from before its first call to
after its last: a second trainer is refused at once, naming the holder. Each
load and label is fenced on the engine's count of weight changes read after
the pause (contract revision 10), so a writer overtaken by another (a
catching-up bridge) is refused rather than labelling someone else's weights;
the record is written only while it holds what it held when the refit began
(compare-and-set), and the lease is renewed just before. A refit that is
cancelled, times out or raises rolls back the workers it sent weights to and
resumes every worker it paused before the cancellation goes on, and before it
lets go of the lease, even if cancelled again (``last_report`` says so); a
write of the record that began runs to its end and counts. A worker that
another writer overtook is not rolled back over that writer's weights, and
one that serves the store's committed version is never taken out of the pool. A
worker where another writer has a weight-transfer update open (contract revision
12) is not touched at all: the refit stops at the pause, nothing sent.

Here once, so that both ways in (``rl_client.refit``: ``RefitClient`` over the
RL routes, ``EngineRefitClient`` over the contract) follow the same rules: each
is a ``FleetCycle`` that says how to pause, load, label, resume, probe and sleep one
worker; ``rl_client.fleet_steps`` runs each step on every worker at once. No
Dynamo import here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_contract.labels import label_problem
from engine_contract.refit_rules import STALE_WRITER, UPDATE_OPEN, pause_mode
from rl_client.committed import (
    UNREAD,
    CommittedRecord,
    CommittedStore,
    CommittedWeights,
    Unread,
    WeightSource,
)
from rl_client.fleet_lease import Leased, default_owner, holding
from rl_client.fleet_steps import each_worker, to_its_end
from rl_client.refit_report import (
    Deadlines,
    Outcome,
    RefitError,
    RefitReport,
    Served,
    WorkerHealth,
    WorkerRefit,
    error_text,
)

__all__ = ["FleetCycle", "RollbackTarget", "Unanswered"]


class Unanswered(Exception):
    """Some workers did not say what they serve before the refit (nothing was sent)."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{w}: {e}" for w, e in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class RollbackTarget:
    """What one worker goes back to when the refit fails."""

    version: str
    source: WeightSource


def _theirs(e: BaseException) -> bool:
    """Whether a refused load or label says another writer holds the worker: it
    changed the weights after this refit's pause (the fence), or has a
    weight-transfer update open there (revision 12): its weights are theirs."""
    return any(words in error_text(e) for words in (STALE_WRITER, UPDATE_OPEN))


class FleetCycle(ABC):
    """The fleet refit's choreography, whatever carries the calls."""

    def __init__(
        self,
        committed: CommittedWeights | None,
        store: CommittedStore | None,
        deadlines: Deadlines | None,
        owner: str | None = None,
    ) -> None:
        # What the whole fleet serves: what a failed refit goes back to. Learnt
        # from each committed refit; None: from the store, else the start state.
        self.committed = committed
        self.store = store
        self.deadlines = deadlines or Deadlines()
        # Who this writer is, as a second trainer's refusal names it.
        self.owner = owner or default_owner()
        self._one_at_a_time = asyncio.Lock()
        # The last refit's report, also one that was cancelled (and undone).
        self.last_report: RefitReport | None = None
        # The record's bytes as the running refit began (its compare-and-set).
        self._record_read: bytes | Unread | None = None

    # -- what each transport does -------------------------------------------

    @abstractmethod
    def _fleet(self) -> list[str]: ...

    @abstractmethod
    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None: ...

    @abstractmethod
    async def _resume(self, worker: str) -> None: ...

    @abstractmethod
    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        """Load ``source``'s weights, the version label left as it is, fenced on
        ``expect`` changes (None: unfenced); the engine's count after it, if known."""

    @abstractmethod
    async def _label(self, worker: str, version: str, expect: int | None) -> int | None:
        """Label the weights ``version``, fenced as ``_load``."""

    async def _changes(self, worker: str) -> int | None:
        """The engine's count of weight changes (None: it keeps none, unfenced)."""
        return None

    @abstractmethod
    async def _serving(self, worker: str) -> Served:
        """The weights the worker serves now."""

    @abstractmethod
    async def _health(self, worker: str) -> WorkerHealth: ...

    @abstractmethod
    async def _sleep(self, worker: str) -> None:
        """Out of the router's pool: asleep, its engine server says NOT_SERVING."""

    @abstractmethod
    def _loads(self, source: WeightSource) -> bool:
        """Whether this transport can load ``source``'s weights."""

    @abstractmethod
    async def _start_state(self) -> dict[str, RollbackTarget]:
        """What each worker was started on, when no refit is known to have
        changed it; ValueError when that cannot be known, ``Unanswered`` naming
        the workers that did not say."""

    # -- the cycle --------------------------------------------------------------

    async def _plan(self) -> dict[str, RollbackTarget]:
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
        return {w: RollbackTarget(committed.version, committed.source) for w in self._fleet()}

    @contextlib.asynccontextmanager
    async def _leased(self) -> AsyncIterator[Leased]:
        """The fleet's lease for the refit (none without a store: nothing to share)."""
        if self.store is None:
            yield Leased()
            return
        async with holding(self.store.lease(), self.owner, self.deadlines.lease_s) as held:
            yield held

    async def _run(
        self, version: str, source: WeightSource, mode: str, clear_cache: bool
    ) -> RefitReport:
        pause_mode(mode)  # ValueError naming the modes, before any call
        problem = label_problem(version)
        if problem is not None:
            raise ValueError(f"version {version!r}: {problem}")
        async with self._one_at_a_time, self._leased() as held:
            started = time.monotonic()
            self._record_read = await self._read_record()
            try:
                plan = await self._plan()
            except Unanswered as e:  # stopped before the pause: nothing changed
                report = RefitReport(version, [WorkerRefit(w) for w in self._fleet()])
                for entry in report.workers:
                    if entry.worker in e.errors:
                        entry.note_failure("pause", e.errors[entry.worker])
                report.seconds = time.monotonic() - started
                self.last_report = report
                raise RefitError(report) from None
            previous = {p.version for p in plan.values()}
            report = RefitReport(
                version,
                [WorkerRefit(w, version=plan[w].version) for w in self._fleet()],
                previous=previous.pop() if len(previous) == 1 else None,
            )
            self.last_report = report
            try:
                await self._commit_or_roll_back(report, source, plan, mode, clear_cache, held)
                await self._resume_staying(report)
            except BaseException as e:
                report.interrupted = (
                    "cancelled" if isinstance(e, asyncio.CancelledError) else error_text(e)
                )
                await self._undo_shielded(report, plan)
                raise
            finally:
                report.seconds = time.monotonic() - started
        if not report.ok:
            raise RefitError(report)
        return report

    async def _read_record(self) -> bytes | Unread | None:
        """The record as the refit begins, under the lease: what its commit may
        replace (an unreadable one: anything, as a trainer given ``committed=``
        may write over it)."""
        if self.store is None:
            return None
        try:
            return await asyncio.to_thread(self.store.read_raw)
        except ValueError:
            return UNREAD

    async def _resume_staying(self, report: RefitReport) -> None:
        staying = [
            w
            for w in report.workers
            if w.paused and w.outcome not in (Outcome.REMOVED, Outcome.ROLLBACK_FAILED)
        ]

        async def resume(entry: WorkerRefit) -> None:
            await self._resume(entry.worker)
            entry.resumed = True

        await each_worker(staying, "resume", self.deadlines.control_s, resume)

    async def _undo_shielded(self, report: RefitReport, plan: dict[str, RollbackTarget]) -> None:
        """Undo an interrupted refit to its end, even when cancelled again meanwhile:
        the lock and the fleet's lease are let go only after it."""
        try:
            _, cancelled = await to_its_end(self._undo(report, plan))
        except Exception:
            return  # written into the report; the interruption is what is raised
        if cancelled:
            raise asyncio.CancelledError

    async def _undo(self, report: RefitReport, plan: dict[str, RollbackTarget]) -> None:
        """After a cancellation or an error: every worker that was sent weights back
        to the committed ones (unless the refit committed), and every worker that
        was paused resumed."""
        if not report.committed:
            sent = [e for e in report.workers if e.sent and e.outcome is Outcome.UNCHANGED]
            for entry in sent:
                entry.changes = None  # the load may or may not have begun: read it again
            if sent:
                await self._roll_back(sent, plan, relabel=True)
        left = [e for e in report.workers if e.paused and not e.resumed]
        await self._resume_staying(RefitReport(report.version, left))

    async def _commit_or_roll_back(
        self,
        report: RefitReport,
        source: WeightSource,
        plan: dict[str, RollbackTarget],
        mode: str,
        clear_cache: bool,
        held: Leased,
    ) -> None:
        entries, limits = report.workers, self.deadlines

        def all_ok() -> bool:
            return all(w.ok for w in entries)

        async def pause(entry: WorkerRefit) -> None:
            # Another writer's transfer update open there (revision 12): its engine
            # refuses our load and would not resume until that update ends; its
            # writer may run it unpaused. Not touched: the refit stops here.
            served = await self._serving(entry.worker)
            if served.update_open:
                raise RuntimeError(
                    f"{UPDATE_OPEN} ({served.mixed or 'no UpdateWeights round sent yet'}), "
                    "another writer's: left to it, not paused"
                )
            entry.paused = True
            await self._pause(entry.worker, mode, clear_cache)
            entry.changes = await self._changes(entry.worker)

        async def load(entry: WorkerRefit) -> None:
            entry.sent = True
            expect, entry.changes = entry.changes, None
            try:
                entry.changes = await self._load(entry.worker, source, expect)
            except Exception as e:
                entry.overtaken = _theirs(e)
                raise

        async def label(entry: WorkerRefit) -> None:
            expect, entry.changes = entry.changes, None
            entry.changes = await self._label(entry.worker, report.version, expect)

        await each_worker(entries, "pause", limits.pause_s, pause)
        if not all_ok():  # nothing was sent: every worker keeps its weights
            return
        await each_worker(entries, "update", limits.update_s, load)
        labelled = all_ok()
        if labelled:
            await each_worker(entries, "label", limits.control_s, label)
        weights = CommittedWeights(report.version, source)
        if all_ok():
            await held.renew()
            lost = held.lost_reason()
            if lost is not None:
                report.publish_error = f"not published: {lost}"
            else:
                # The commit point runs to its end: a write that lands is reported.
                published, cancelled = await to_its_end(self._publish(report, weights))
                if published:
                    report.committed = True
                    self.committed = weights
                    for entry in entries:
                        entry.outcome, entry.version = Outcome.UPDATED, report.version
                if cancelled:
                    raise asyncio.CancelledError
                if published:
                    return
        await self._roll_back(entries, plan, relabel=labelled)

    async def _publish(self, report: RefitReport, weights: CommittedWeights) -> bool:
        """The commit point: the record says the new version, or the refit fails
        (the record then holds what it held before). A compare-and-set: written
        only while the record still holds what it held when this refit began."""
        store = self.store
        if store is None:
            return True
        before = self._record_read
        new = CommittedRecord.now(weights, self._fleet()).to_json()
        try:
            await asyncio.to_thread(store.swap, before, new)
            return True
        except Exception as e:
            report.publish_error = error_text(e)
        try:  # it may have been written all the same: put back what was there
            restore = None if isinstance(before, Unread) else before
            await asyncio.to_thread(store.swap, new, restore)
        except Exception as e:
            report.publish_error += f"; restoring the previous record: {error_text(e)}"
        return False

    async def _roll_back(
        self, entries: list[WorkerRefit], plan: dict[str, RollbackTarget], *, relabel: bool
    ) -> None:
        """Every worker back to the committed weights under its old version, fenced
        on the count of changes this refit made; one that cannot go back leaves
        the router's pool, unless it serves the store's committed version."""

        async def back(entry: WorkerRefit) -> None:
            previous = plan[entry.worker]
            if entry.overtaken:
                raise RuntimeError(
                    f"{STALE_WRITER} (this refit, overtaken by another writer): not rolled "
                    "back over that writer's weights"
                )
            try:
                if entry.changes is None:
                    entry.changes = await self._changes(entry.worker)
                expect, entry.changes = entry.changes, None
                entry.changes = await self._load(entry.worker, previous.source, expect)
                if relabel:
                    expect, entry.changes = entry.changes, None
                    entry.changes = await self._label(entry.worker, previous.version, expect)
            except Exception as e:
                entry.overtaken = _theirs(e)
                raise

        await each_worker(entries, "rollback", self.deadlines.rollback_s, back)
        for entry in entries:
            if entry.rollback_error is None:
                entry.outcome = Outcome.ROLLED_BACK
                entry.version = plan[entry.worker].version
        failed = [e for e in entries if e.rollback_error is not None]
        if failed:
            committed = await self._committed_version()
            await asyncio.gather(*(self._remove(e, committed) for e in failed))

    async def _committed_version(self) -> str | None:
        """The store's committed version now (None: no store, or none readable)."""
        if self.store is None:
            return None
        try:
            record = await asyncio.to_thread(self.store.read)
        except Exception:
            return None
        return record.weights.version if record is not None else None

    async def _remove(self, entry: WorkerRefit, committed: str | None) -> None:
        """Out of the pool a worker that could not be brought back: its engine
        server already says NOT_SERVING (its weights unknown) or does not answer, or
        it is put to sleep now; the bridge follows its health and leaves. Never one
        that another writer overtook and that holds the store's committed version
        (``Served.holds``: its label is theirs; this refit's may lie about its weights)."""
        started = time.monotonic()
        limit = self.deadlines.control_s
        try:
            async with asyncio.timeout(limit):
                health = await self._health(entry.worker)
        except Exception:
            health = WorkerHealth.UNREACHABLE
        if health is WorkerHealth.SERVING and committed is not None and entry.overtaken:
            try:
                async with asyncio.timeout(limit):
                    serving = await self._serving(entry.worker)
            except Exception:
                serving = None
            if serving is not None and serving.holds(committed):
                entry.rollback_s += time.monotonic() - started
                entry.outcome, entry.version = Outcome.ON_COMMITTED, committed
                entry.rollback_error = (
                    f"{entry.rollback_error}; left in the pool: it serves the committed "
                    f"version {committed!r}"
                    + (", under an update its writer has open" if serving.update_open else "")
                )
                return
        if health is WorkerHealth.SERVING:
            try:
                async with asyncio.timeout(limit):
                    await self._sleep(entry.worker)
                health = WorkerHealth.NOT_SERVING
            except Exception as e:
                message = (
                    f"did not go to sleep within {limit:g} s"
                    if isinstance(e, TimeoutError)
                    else error_text(e)
                )
                entry.rollback_error = f"{entry.rollback_error}; taking it out failed: {message}"
        entry.rollback_s += time.monotonic() - started
        entry.version = None
        if health is WorkerHealth.SERVING:
            entry.outcome = Outcome.ROLLBACK_FAILED
        else:
            entry.outcome = Outcome.REMOVED
            entry.rollback_error = f"{entry.rollback_error}; out of the pool ({health.value})"
