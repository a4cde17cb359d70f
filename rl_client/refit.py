"""The trainer's side of the refit cycle: every worker on the new weights, or none.

Two ways in, the same cycle and the same report:

- ``RefitClient(worker_urls)``: over each Dynamo worker's RL admin routes (its
  system port, ``/engine/pause_generation`` ...), exactly as a trainer drives
  ``dynamo.vllm --enable-rl``; the new weights come from a checkpoint folder
  every worker can read. It sends the workers' admin token (``rl_client.admin_token``:
  given, or read as a bridge reads it, ``$BRIDGE_ADMIN_TOKEN_FILE`` or
  ``$BRIDGE_ADMIN_TOKEN``) as ``Authorization: Bearer``.
- ``EngineRefitClient(engine_addresses)``: over the engine servers' contract
  (gRPC, ``rl_client.refit_rpc``; TLS as the bridge's with ``tls=``); the new
  weights come from a folder or are streamed from the trainer's memory
  (``engine_contract.tensors``), no shared filesystem needed.

Either finds its workers through Dynamo's discovery with ``from_discovery(namespace)``
(``rl_client.fleet_discovery``: the workers registered now), instead of a list.

For vLLM's trainer-side weight-transfer engines (NCCL; ``gloo`` on CPUs), two
``VLLMWeightSyncClient``s: ``ContractWeightSyncClient`` (the contract's phases,
gRPC) and ``DynamoWeightSyncClient`` (a worker's RL routes, called as NeMo RL
calls them).

A step is all or nothing across the fleet (docs/refit.md, "Refit across a
fleet"), so that rollouts never mix two policies: pause every worker, load the
new weights on all at once, and only once every load succeeded label them with
the version, publish it (``store``: ``rl_client.committed``) and resume.
Otherwise every worker that was sent the weights goes back to the fleet's
committed ones (the checkpoint reloaded, or the trainer's previous tensors sent
again) under its old version, and resumes; one that cannot go back is taken out
of the router's pool (asleep: health NOT_SERVING, which its bridge follows)
rather than serve a third version. ``RefitError`` carries the report: each
worker's outcome, its timings, and why. No Dynamo import here: trainers install
only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import grpc
from grpc_health.v1 import health_pb2

from engine_contract.labels import label_problem
from engine_contract.refit_rules import pause_mode
from engine_contract.tensors import DEFAULT_CHUNK_BYTES, Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from rl_client.admin_token import AdminToken
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedStore,
    CommittedWeights,
    PushedSource,
    WeightSource,
)
from rl_client.fleet_discovery import FleetDiscovery, FleetWorker, discover_workers
from rl_client.refit_rpc import DEFAULT_MAX_MESSAGE_BYTES, RefitRpc
from rl_client.tls import TlsOptions

T = TypeVar("T")


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


def _discovered(
    namespace: str,
    component: str,
    model: str | None,
    discovery: FleetDiscovery | None,
    field_name: str,
) -> list[FleetWorker]:
    """The live workers found in discovery; ValueError when there are none, or one
    has no ``field_name`` (a bridge serving no admin routes, say)."""
    workers = discover_workers(namespace, component, model=model, discovery=discovery)
    serving = f" serving {model!r}" if model is not None else ""
    if not workers:
        raise ValueError(
            f"no live worker of {namespace}/{component}{serving} in discovery (none "
            "registered, or none of them a bridge that publishes its RL record)"
        )
    lacking = [w for w in workers if getattr(w, field_name) is None]
    if lacking:
        raise ValueError(
            f"{len(lacking)} of the {len(workers)} workers of {namespace}/{component}{serving} "
            f"published no {field_name} (instances {[hex(w.instance_id) for w in lacking]})"
        )
    return workers


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


class RouteError(RuntimeError):
    """A route answered ``{"status": "error"}`` (or not JSON, or not 200)."""


class RefitClient(_Cycle):
    """The cycle over Dynamo workers' RL admin routes (their system URLs).

    ``admin_token``: the workers' token; None (the default) reads it from the
    environment as a bridge does (``AdminToken.from_env``), and sends none when
    neither variable is set. The routes load checkpoints only, and cannot tell
    which one a worker started on: a failed refit goes back to ``committed``
    (the checkpoint the fleet serves), else the ``store``'s record, else this
    client's last committed refit; with none of them ``refit`` refuses before
    any call. ``deadlines``: per worker and step (``Deadlines``)."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float | None = None,
        admin_token: str | AdminToken | None = None,
        committed: CommittedWeights | None = None,
        store: CommittedStore | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("no worker URLs")
        super().__init__(committed, store, deadlines)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        if isinstance(admin_token, str):
            admin_token = AdminToken(admin_token, "the admin_token argument")
        elif admin_token is None:
            admin_token = AdminToken.from_env()
        self._headers = admin_token.header() if admin_token is not None else {}
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # The workers as discovery listed them (``from_discovery``), else empty.
        self.discovered: list[FleetWorker] = []

    @classmethod
    def from_discovery(
        cls,
        namespace: str,
        component: str = "backend",
        *,
        model: str | None = None,
        discovery: FleetDiscovery | None = None,
        **options: Any,
    ) -> RefitClient:
        """A client for the workers of ``namespace``/``component`` (serving ``model``,
        when given) that are registered now, their admin URLs read from Dynamo's
        discovery (``rl_client.fleet_discovery``; ``discovery``: the environment's by
        default). ``options``: the constructor's. A blocking read: call it again for
        each step to follow the fleet. ValueError when no worker is found, or one
        serves no admin routes."""
        workers = _discovered(namespace, component, model, discovery, "admin_url")
        client = cls([str(w.admin_url) for w in workers], **options)
        client.discovered = workers
        return client

    async def __aenter__(self) -> RefitClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, worker: str, route: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        if self._session is None:
            # No cap on connections: every worker is called at once (aiohttp's default
            # of 100 would queue a larger fleet's pause behind the first hundred).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self._session.post(
            f"{worker}/engine/{route}",
            json=body or {},
            timeout=self._timeout,
            headers=self._headers,
        ) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None

    async def call(
        self, worker: str, route: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One route of one worker; RouteError unless it answered ``status: ok``."""
        status, answer = await self._post(worker, route, body)
        if status != 200 or not isinstance(answer, dict):
            raise RouteError(f"{route}: HTTP {status}: {answer!r}")
        if answer.get("status") != "ok":
            raise RouteError(f"{route}: {answer.get('message', answer)}")
        return answer

    def _fleet(self) -> list[str]:
        return self.worker_urls

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self.call(worker, "pause_generation", {"mode": mode, "clear_cache": clear_cache})

    async def _resume(self, worker: str) -> None:
        await self.call(worker, "resume_generation")

    async def _load(self, worker: str, source: WeightSource) -> None:
        if not isinstance(source, CheckpointSource):
            raise RouteError(
                "the RL routes load checkpoints only; stream tensors over the contract"
            )
        await self.call(worker, "update_weights_from_disk", {"model_path": source.path})

    async def _label(self, worker: str, version: str) -> None:
        await self.call(worker, "set_weight_version", {"weight_version": version})

    async def _health(self, worker: str) -> Health:
        """The bridge's own view (``liveness_probe``): its engine server serving."""
        try:
            status, answer = await self._post(worker, "liveness_probe", None)
        except (aiohttp.ClientError, OSError):
            return Health.UNREACHABLE
        if status == 200 and isinstance(answer, dict):
            if answer.get("status") == "ok":
                return Health.SERVING
            if answer.get("alive") is False:
                return Health.NOT_SERVING
        raise RouteError(f"liveness_probe: HTTP {status}: {answer!r}")

    async def _sleep(self, worker: str) -> None:
        await self.call(worker, "control/sleep", {"level": 1})

    def _loads(self, source: WeightSource) -> bool:
        return isinstance(source, CheckpointSource)

    async def _start_state(self) -> dict[str, _Previous]:
        raise ValueError(
            "RefitClient cannot undo a failed refit without knowing the checkpoint the "
            "fleet serves now: give committed=CommittedWeights(version, "
            "CheckpointSource(path)), or a store= holding the fleet's record"
        )

    async def refit(
        self, model_path: str, version: str, *, mode: str = "wait", clear_cache: bool = True
    ) -> RefitReport:
        """Pause every worker (``mode``: wait for rollouts in flight, abort them, or
        keep them frozen), load ``model_path`` on all, and label them ``version``
        and resume once all loaded; otherwise all go back (``RefitError``)."""
        return await self._run(version, CheckpointSource(model_path), mode, clear_cache)

    async def resume(self, workers: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(self._resume(w) for w in workers or self.worker_urls))

    async def versions(self) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(self.call(w, "get_weight_version") for w in self.worker_urls)
        )
        return {w: a.get("version") for w, a in zip(self.worker_urls, answers, strict=True)}


class EngineRefitClient(_Cycle):
    """The cycle over engine servers' contract (gRPC), weights streamed or from a folder.

    ``tls``: TLS to the engine servers, as the bridge's ``--engine-tls-*`` options
    (a CA, and a client certificate and key for an mTLS engine server); None:
    plaintext. Open it inside the event loop that uses it. A failed refit goes
    back to ``committed``, else the ``store``'s record, else this client's last
    committed refit (streamed weights: it keeps the tensors, which must stay
    unchanged), else the checkpoint each engine server started on when none has
    had a version set since. ``deadlines``: per worker and step."""

    def __init__(
        self,
        engine_addresses: Sequence[str],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: TlsOptions | None = None,
        committed: CommittedWeights | None = None,
        store: CommittedStore | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        if not engine_addresses:
            raise ValueError("no engine server addresses")
        super().__init__(committed, store, deadlines)
        self._engines = {
            a: RefitRpc.connect(a, tls=tls, max_message_bytes=max_message_bytes)
            for a in engine_addresses
        }
        # The workers as discovery listed them (``from_discovery``), else empty.
        self.discovered: list[FleetWorker] = []
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)

    @classmethod
    def from_discovery(
        cls,
        namespace: str,
        component: str = "backend",
        *,
        model: str | None = None,
        discovery: FleetDiscovery | None = None,
        tls: TlsOptions | None = None,
        **options: Any,
    ) -> EngineRefitClient:
        """A client for the engine servers of the workers of ``namespace``/``component``
        (serving ``model``, when given) registered now, their addresses as each
        bridge dials them, read from Dynamo's discovery (``rl_client.fleet_discovery``).
        ``tls`` and ``options``: the constructor's. A blocking read; open it inside
        the event loop that uses it. ValueError when no worker is found, or a
        worker's bridge reaches its engine over TLS and no ``tls`` is given."""
        workers = _discovered(namespace, component, model, discovery, "engine_address")
        over_tls = [w for w in workers if w.engine_tls]
        if over_tls and tls is None:
            raise ValueError(
                f"the engine servers {[w.engine_address for w in over_tls]} are reached over "
                "TLS: give tls= (as the bridges' --engine-tls-* options)"
            )
        client = cls([str(w.engine_address) for w in workers], tls=tls, **options)
        client.discovered = workers
        return client

    async def __aenter__(self) -> EngineRefitClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(engine.close() for engine in self._engines.values()))

    def _fleet(self) -> list[str]:
        return list(self._engines)

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self._engines[worker].pause_generation(
            pb.PauseGenerationRequest(mode=pause_mode(mode), clear_cache=clear_cache)
        )

    async def _resume(self, worker: str) -> None:
        await self._engines[worker].resume_generation()

    async def _load(self, worker: str, source: WeightSource) -> None:
        engine = self._engines[worker]
        if isinstance(source, CheckpointSource):
            await engine.update_weights_from_path(
                pb.UpdateWeightsFromPathRequest(path=source.path, options=pb.WeightUpdateOptions())
            )
        elif source.tensors is not None:
            requests = update_requests(source.tensors, chunk_bytes=self._chunk_bytes)
            await engine.update_weights_from_tensors(requests)
        else:
            raise ValueError("weights pushed by a trainer, with no copy of the tensors")

    async def _label(self, worker: str, version: str) -> None:
        await self._engines[worker].update_weight_version(
            pb.UpdateWeightVersionRequest(weight_version=version)
        )

    async def _health(self, worker: str) -> Health:
        try:
            status = await self._engines[worker].health()
        except grpc.aio.AioRpcError:
            return Health.UNREACHABLE
        return (
            Health.SERVING
            if status == health_pb2.HealthCheckResponse.SERVING
            else (Health.NOT_SERVING)
        )

    async def _sleep(self, worker: str) -> None:
        await self._engines[worker].sleep(pb.SleepRequest(level=1, mode=pb.PAUSE_MODE_ABORT))

    def _loads(self, source: WeightSource) -> bool:
        return True

    async def _start_state(self) -> dict[str, _Previous]:
        limit = self.deadlines.control_s

        async def one(worker: str) -> _Previous:
            try:
                async with asyncio.timeout(limit):
                    info = await self._engines[worker].server_info()
            except TimeoutError:
                raise _Unanswered({worker: f"did not answer within {limit:g} s"}) from None
            except grpc.aio.AioRpcError as e:
                raise _Unanswered({worker: _why(e)}) from None
            state = info.refit_state
            why = (
                f"serves version {state.weight_version!r} set by a refit this client did not make"
                if state.weight_version_declared
                else "names no checkpoint it started on"
                if not info.model_path
                else ""
            )
            if why:
                raise ValueError(
                    f"engine server {worker} {why}, so a failed refit could not be undone: "
                    "give committed=CommittedWeights(version, source), or a store= holding "
                    "the fleet's record"
                )
            return _Previous(state.weight_version, CheckpointSource(info.model_path))

        workers = self._fleet()
        states = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        unanswered: dict[str, str] = {}
        for state in states:
            if isinstance(state, ValueError):
                raise state
            if isinstance(state, _Unanswered):
                unanswered |= state.errors
            elif isinstance(state, BaseException):
                raise state
        if unanswered:
            raise _Unanswered(unanswered)
        return {w: s for w, s in zip(workers, states, strict=True) if isinstance(s, _Previous)}

    async def refit(
        self,
        version: str,
        *,
        tensors: Sequence[Tensor] | None = None,
        path: str | None = None,
        mode: str = "wait",
        clear_cache: bool = True,
    ) -> RefitReport:
        """Pause every engine server, load ``tensors`` (streamed to each) or
        ``path`` on all, and label them ``version`` and resume once all loaded;
        otherwise all go back (``RefitError``). Streamed tensors are kept (not
        copied) as what the next failed refit goes back to."""
        if (tensors is None) == (path is None):
            raise ValueError("give either tensors or path")
        source: WeightSource = CheckpointSource(path) if path is not None else PushedSource(tensors)
        return await self._run(version, source, mode, clear_cache)

    async def resume(self, workers: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(self._resume(w) for w in workers or list(self._engines)))

    @property
    def engines(self) -> list[str]:
        """The engine servers' addresses, as given."""
        return list(self._engines)

    async def restore(self, worker: str, *, mode: str = "abort") -> bool:
        """Put one engine server that lags the fleet (restarted: it serves its start
        weights) back on the committed weights: pause (``mode``: what it runs now
        runs on other weights), load, label, resume. Under the lock every refit of
        this client takes, so it never interleaves with one, and checked again
        there: False when the engine serves the committed version already (a refit
        brought it there meanwhile). ValueError when nothing is committed, or the
        committed weights cannot be sent again (``CommittedWeights.resendable``)."""
        async with self._one_at_a_time:
            committed = self.committed
            if committed is None or not committed.resendable:
                raise ValueError(
                    f"no committed weights this client can send again ({committed}): "
                    "refit first, or give committed= with the tensors or a checkpoint"
                )
            engine, limits = self._engines[worker], self.deadlines
            async with asyncio.timeout(limits.control_s):
                serving = await engine.get_weight_version()
            if serving.declared and serving.weight_version == committed.version:
                return False
            async with asyncio.timeout(limits.pause_s):
                await self._pause(worker, mode, clear_cache=True)
            async with asyncio.timeout(limits.update_s):
                await self._load(worker, committed.source)
            async with asyncio.timeout(limits.control_s):
                await self._label(worker, committed.version)
                await self._resume(worker)
            return True


class ContractWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (its four methods) over the contract, so that
    vLLM's trainer-side weight-transfer engines (``NCCLTrainerWeightTransferEngine``
    and the like) drive an engine server directly:

        client = ContractWeightSyncClient("10.0.0.5:50051", weight_version="42")
        engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client,
                                                              source=ModuleSource(model))
        ... PauseGeneration ...; engine.send_weights(); ... ResumeGeneration ...

    The engine server refuses the update unless generation is paused (or
    ``allow_unpaused``); ``weight_version`` is set when the update finishes.
    ``tls``: as ``EngineRefitClient``'s. Blocking calls, as vLLM's trainer engines
    make them (from their threads): each runs the typed ``RefitRpc`` on an event
    loop of the client's own (a thread), so calls from several threads overlap.
    """

    def __init__(
        self,
        address: str,
        *,
        weight_version: str | None = None,
        allow_unpaused: bool = False,
        timeout_s: float | None = None,
        tls: TlsOptions | None = None,
    ) -> None:
        self.weight_version = weight_version
        self.allow_unpaused = allow_unpaused
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="contract-weight-sync", daemon=True
        )
        self._thread.start()

        async def connect() -> RefitRpc:  # the channel belongs to the client's loop
            return RefitRpc.connect(address, tls=tls, timeout_s=timeout_s)

        self._rpc = self._call(connect())

    def _call(self, call: Awaitable[T]) -> T:
        async def run() -> T:
            return await call

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._rpc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(
            self._rpc.init_weight_transfer_engine(
                pb.InitWeightTransferEngineRequest(init_info_json=json.dumps(init_info).encode())
            )
        )

    def start_weight_update(self) -> None:
        options = pb.WeightUpdateOptions(allow_unpaused=self.allow_unpaused)
        self._call(self._rpc.start_weight_update(pb.StartWeightUpdateRequest(options=options)))

    def update_weights(self, update_info: Any) -> None:
        self._call(
            self._rpc.update_weights(
                pb.UpdateWeightsRequest(update_info_json=json.dumps(update_info).encode())
            )
        )

    def finish_weight_update(self) -> None:
        request = pb.FinishWeightUpdateRequest()
        if self.weight_version is not None:
            request.weight_version = self.weight_version
        self._call(self._rpc.finish_weight_update(request))

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self._rpc.shutdown_weight_transfer_engine())


class DynamoWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (its four methods) over a Dynamo worker's RL
    admin routes, calling them exactly as NeMo RL's Dynamo backend does, so that
    vLLM's trainer-side weight-transfer engines drive a worker through its system
    port (``dynamo.vllm --enable-rl``, or this bridge):

        client = DynamoWeightSyncClient("http://worker-0:9090", weight_version="42")
        engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client,
                                                              source=ModuleSource(model))
        engine.send_weights()  # start, update (while broadcasting), finish

    - ``init_weight_transfer_engine(info)``: ``POST /engine/init_weights_update_group``
      ``{"engine_rpc": "init_weight_transfer_engine", "init_info": info}``;
    - ``start_weight_update()``, ``update_weights(info)``, ``finish_weight_update()``:
      ``POST /engine/update_weights_from_distributed`` with that ``engine_rpc``
      (``is_checkpoint_format``, ``update_info``), each with NeMo RL's
      ``allow_unpaused: true, reset_prefix_cache: false`` (the constructor's
      ``allow_unpaused``/``reset_prefix_cache`` change them), and ``weight_version``
      on the finish when one is given (here or to ``finish_weight_update``);
    - ``shutdown_weight_transfer_engine()``: ``POST /engine/destroy_weights_update_group``.

    Blocking calls (plain ``urllib``, one request each, so calls from several
    threads overlap), as vLLM's trainer engines make them. ``admin_token``: as
    ``RefitClient``'s (None reads it as a bridge does). An answer other than
    ``status: ok`` raises ``RouteError`` with its message. ``call(route, body)``
    reaches any other route (``pause_generation``, ``resume_generation``, ...).
    """

    def __init__(
        self,
        worker_url: str,
        *,
        weight_version: str | None = None,
        allow_unpaused: bool = True,
        reset_prefix_cache: bool = False,
        timeout_s: float | None = 300.0,
        admin_token: str | AdminToken | None = None,
    ) -> None:
        self.worker_url = worker_url.rstrip("/")
        self.weight_version = weight_version
        self.flags = {"allow_unpaused": allow_unpaused, "reset_prefix_cache": reset_prefix_cache}
        self.timeout_s = timeout_s
        if isinstance(admin_token, str):
            admin_token = AdminToken(admin_token, "the admin_token argument")
        elif admin_token is None:
            admin_token = AdminToken.from_env()
        self._headers = {
            "Content-Type": "application/json",
            **(admin_token.header() if admin_token is not None else {}),
        }

    def call(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /engine/<route>``; the answer, or RouteError unless ``status: ok``."""
        request = urllib.request.Request(
            f"{self.worker_url}/engine/{route}",
            data=json.dumps(body or {}, allow_nan=False).encode(),
            headers=self._headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            raise RouteError(f"{route}: HTTP {status}: {answer!r}")
        if answer.get("status") != "ok":
            raise RouteError(f"{route}: {answer.get('message', answer)}")
        return answer

    def _phase(self, engine_rpc: str, **kwargs: Any) -> dict[str, Any]:
        return self.call(
            "update_weights_from_distributed", {"engine_rpc": engine_rpc, **kwargs, **self.flags}
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call(
            "init_weights_update_group",
            {"engine_rpc": "init_weight_transfer_engine", "init_info": init_info},
        )

    def start_weight_update(self) -> None:
        self._phase("start_weight_update", is_checkpoint_format=True)

    def update_weights(self, update_info: Any) -> None:
        self._phase("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.weight_version
        if version is None:
            self._phase("finish_weight_update")
        else:
            self._phase("finish_weight_update", weight_version=version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("destroy_weights_update_group", {"engine_rpc": "shutdown_weight_transfer_engine"})
