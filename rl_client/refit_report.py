"""What a fleet refit is given and gives back (``rl_client.fleet_cycle`` runs it):
its deadlines per worker and step, each worker's outcome, its engine's health as
its bridge sees it and the weights it says it serves, the report, and the error
that carries it. No Dynamo
import here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

__all__ = [
    "Deadlines",
    "Outcome",
    "RefitError",
    "RefitReport",
    "Served",
    "WorkerHealth",
    "WorkerRefit",
    "error_text",
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
    # Could not be brought back, but serves the store's committed version (another
    # writer's): left serving, never taken out.
    ON_COMMITTED = "serving the committed version"


class WorkerHealth(enum.Enum):
    """A worker's engine as its bridge sees it: anything but SERVING takes the worker
    out of the router's pool (``bridge/engine_watch.py``)."""

    SERVING = "serving"
    NOT_SERVING = "not serving"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Served:
    """The weights a worker says it serves (contract revision 12; an older bridge's
    answer, without the last two, reads as whole and no update open)."""

    version: str  # the label
    mixed: str = ""  # why the weights are not whole under it (an unfinished update)
    update_open: bool = False  # a weight-transfer update under way: its writer's

    def holds(self, version: str) -> bool:
        """Whether this is ``version`` as far as anyone may act on it: its weights
        whole, or an update open that is its writer's to finish."""
        return self.version == version and (self.update_open or not self.mixed)


@dataclass(frozen=True)
class Deadlines:
    """How long one worker may take per step, in seconds (None: no limit).

    Past it the call is cancelled and the worker counts as failed. Its engine may
    still finish the step (an engine server never stops a load half way), which
    is why such a worker is sent the rollback too: the engine server runs it
    after, under its refit lock. A pause gets two minutes (a WAIT pause lasts
    until the rollouts in flight end; a worker that does not stop by then fails
    the refit and every other worker resumes); a load has no limit by default (a
    large checkpoint loads for its time), a rollback half an hour (the engine
    server's own refit deadline); labelling, resuming, health and sleep get
    ``control_s``. ``lease_s``: the fleet lease's time to live, renewed every
    third of it while the refit runs (a trainer that dies frees the fleet then)."""

    pause_s: float | None = 120.0
    update_s: float | None = None
    rollback_s: float | None = 1800.0
    control_s: float | None = 30.0
    lease_s: float = 30.0


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
    # The engine's count of weight changes this refit expects next (the fence;
    # None: not known, read again before a rollback, or an engine without one).
    changes: int | None = None
    # Whether a pause, or weights, were sent (what an interrupted refit undoes).
    paused: bool = False
    sent: bool = False
    # Whether another writer changed its weights after this refit did (a fenced
    # rollback refused): what it serves is theirs, not this refit's.
    overtaken: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.rollback_error is None

    def note_failure(self, stage: str, message: str) -> None:
        """Keep ``message`` as its failure at ``stage``: a rollback's apart, else the first."""
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
    # Why the refit stopped part way (cancelled, timed out, raised); its pauses
    # and loads were undone before it ended.
    interrupted: str | None = None

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


def error_text(e: BaseException) -> str:
    """An error as a report names it: a gRPC error's code and details, else its text."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__
