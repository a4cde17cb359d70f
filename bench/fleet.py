"""Part 9 ("fleet"): a fleet of N sim workers on this machine, each an engine server
plus a bridge (file discovery), for N = 1, 2, 4, 8 (``--fleet-sizes``):

- the fleet refit's wall time (pause -> update -> label -> resume on every worker,
  all or nothing: ``rl_client.fleet_cycle``) against N, for a synthetic checkpoint
  of a few hundred MB (``--fleet-mb``; ``refit_checkpoints.synthetic_model``), three
  ways: the checkpoint folder loaded by every worker over the bridges' RL admin
  routes (``RefitClient``, as a trainer drives ``dynamo.vllm --enable-rl``) and
  over the contract (``EngineRefitClient(path=...)``), and the tensors pushed
  from the trainer's memory to every engine server over the contract
  (``EngineRefitClient(tensors=...)``). The sim engine reads and digests every
  byte of a load (a folder: every tensor mapped and hashed; streamed: every chunk
  hashed as it arrives, ``engine_server/backends/sim/weights.py``), and each refit
  loads the other of two checkpoints, so every refit moves every byte;
- how concurrent the fan-out is: the update calls' summed durations over the
  update stage's wall time (1: one worker after the other; N: all at once);
- the time for the N workers to register: from starting the 2N processes to all
  N in the discovery store, and to the model at the frontend's ``/v1/models``;
- memory per worker: the RSS of its engine server plus its bridge, once
  registered and after the refits.

A size is measured only where this machine's available memory holds it
(``WORKER_BUDGET_MB`` per worker, about twice what one takes after refits), so
that 16 is in the default list and left out, saying so, where memory is short.

Goals (issue 31): the disk refit (RL routes) of 8 workers takes at most twice
that of one, and its updates run concurrently (overlap at N = 8 at least 4).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.context import Bench, say
from bench.refit_checkpoints import synthetic_model
from bench.report import Goal, fmt, goal_table, table
from bench.stats import median, rotate
from engine_contract.tensors import Tensor
from harness.checkpoints import checkpoint_tensors
from harness.http import http_json, served_models
from harness.ports import free_port, free_system_port
from harness.procs import Proc
from harness.progress import waiting
from harness.stack import registered_workers
from harness.waits import wait_until
from rl_client.committed import CheckpointSource, CommittedWeights, WeightSource
from rl_client.refit import EngineRefitClient, RefitClient

DISK_ROUTES = "disk, RL routes"
DISK_CONTRACT = "disk, contract"
STREAMED = "streamed, contract"
PATHS = (DISK_ROUTES, DISK_CONTRACT, STREAMED)

DEFAULT_SIZES = (1, 2, 4, 8, 16)
DEFAULT_MB = 256
QUICK_MB = 32
DEFAULT_REPS = 3
# Issue 31: the disk refit of GOAL_WORKERS workers within GOAL_RATIO of one
# worker's, and its update calls overlapping (a concurrent fan-out).
GOAL_WORKERS = 8
GOAL_RATIO = 2.0
GOAL_OVERLAP_SHARE = 0.5  # of GOAL_WORKERS: at least 4 calls at once on average
MB = 1e6
# What a size needs of the available memory: per worker (an engine server and a
# bridge take about 180 MB idle, up to about 300 MB after streamed refits), and
# for the rest (the trainer's two checkpoints in memory are counted apart).
WORKER_BUDGET_MB = 600
SPARE_MB = 2000


@dataclass(frozen=True)
class FleetSettings:
    """The part's own options (``--fleet-sizes``, ``--fleet-mb``, ``--fleet-reps``);
    None: the default (smaller with ``--quick``)."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    mb: int | None = None
    reps: int | None = None


@dataclass
class PathRuns:
    """One refit path at one fleet size: per measured repetition."""

    wall_s: list[float] = field(default_factory=list)
    # The update stage: first call's start to last call's end.
    update_s: list[float] = field(default_factory=list)
    # The update calls' summed durations over update_s.
    overlap: list[float] = field(default_factory=list)
    # CPU seconds of this process (the trainer), all engine servers, all bridges.
    trainer_cpu_s: list[float] = field(default_factory=list)
    engine_cpu_s: list[float] = field(default_factory=list)
    bridge_cpu_s: list[float] = field(default_factory=list)
    # Weight bytes the trainer itself sent (streamed only).
    trainer_sent_mb: float = 0.0
    # Every process's CPU seconds over the wall time and the machine's CPUs.
    machine_busy: list[float] = field(default_factory=list)


@dataclass
class Memory:
    """Median RSS per process, MB."""

    engine_mb: float
    bridge_mb: float

    @property
    def worker_mb(self) -> float:
        return self.engine_mb + self.bridge_mb


@dataclass
class FleetRow:
    workers: int
    # From the first process's start: all N in the discovery store; the model
    # listed at the frontend (its first worker found).
    register_s: float
    frontend_s: float
    idle: Memory
    after_refits: Memory
    paths: dict[str, PathRuns] = field(default_factory=dict)

    def wall(self, path: str) -> float:
        runs = self.paths.get(path)
        return median(runs.wall_s) if runs else float("nan")

    def overlap(self, path: str) -> float:
        runs = self.paths.get(path)
        return median(runs.overlap) if runs else float("nan")


@dataclass
class Fleet:
    checkpoint_mb: float
    reps: int
    rows: list[FleetRow]
    # Sizes left out, and why (memory).
    skipped: dict[int, str] = field(default_factory=dict)

    def row(self, workers: int) -> FleetRow | None:
        return next((r for r in self.rows if r.workers == workers), None)

    def goals(self) -> list[Goal]:
        """Issue 31's, when both one and GOAL_WORKERS workers were measured (a row
        without the disk path measured misses them)."""
        one, many = self.row(1), self.row(GOAL_WORKERS)
        if one is None or many is None:
            return []
        ratio = many.wall(DISK_ROUTES) / one.wall(DISK_ROUTES)
        overlap = many.overlap(DISK_ROUTES)
        return [
            Goal.at_most(
                f"disk refit (RL routes), {GOAL_WORKERS} workers over 1",
                float("inf") if math.isnan(ratio) else ratio,
                GOAL_RATIO,
                "x",
            ),
            Goal.at_least(
                f"disk updates running at once, {GOAL_WORKERS} workers",
                0.0 if math.isnan(overlap) else overlap,
                GOAL_WORKERS * GOAL_OVERLAP_SHARE,
            ),
        ]

    def render(self) -> str:
        lines = [
            "## 9. A fleet of sim workers: refit, registration and memory against N",
            "",
            f"N workers, each a sim engine server plus a bridge on this machine (file "
            f"discovery); a synthetic {fmt(self.checkpoint_mb)} MB checkpoint, every refit "
            f"to the other of two (every byte read or received, and hashed, by every "
            f"engine server). Medians of {self.reps} refits per path: the whole "
            "all-or-nothing cycle (pause, update, label, resume); the update stage "
            "alone; overlap = the update calls' summed time over the stage's (1: one "
            "worker after the other, N: all at once); what the trainer sends itself; "
            "CPU per refit of the trainer, of each engine server and each bridge; "
            "machine busy = all of that CPU over the refit's wall time and the "
            "machine's CPUs (near 100%: the cores, not the fan-out, set the time).",
            "",
        ]
        base = {p: r.wall(p) for r in self.rows[:1] for p in r.paths}
        out = []
        for row in self.rows:
            for path, runs in row.paths.items():
                n = row.workers
                out.append(
                    [
                        n,
                        path,
                        fmt(row.wall(path) * 1000, 0),
                        f"{row.wall(path) / base[path]:.2f}" if path in base else "",
                        fmt(median(runs.update_s) * 1000, 0),
                        f"{row.overlap(path):.1f}",
                        fmt(runs.trainer_sent_mb, 0) if runs.trainer_sent_mb else "",
                        fmt(median(runs.trainer_cpu_s) * 1000, 0),
                        fmt(median(runs.engine_cpu_s) * 1000 / n, 0),
                        fmt(median(runs.bridge_cpu_s) * 1000 / n, 0),
                        f"{median(runs.machine_busy) * 100:.0f}%",
                    ]
                )
        first = self.rows[0].workers if self.rows else 1
        lines += table(
            [
                "workers",
                "weights from",
                "refit ms",
                f"vs N={first}",
                "update ms",
                "overlap",
                "trainer sends MB",
                "trainer CPU ms",
                "engine CPU ms / worker",
                "bridge CPU ms / worker",
                "machine busy",
            ],
            "rlrrrrrrrrr",
            out,
        )
        lines += [
            "",
            "Registration (the 2N processes started at once, from the first start) and "
            "memory (median RSS per process; a worker is one engine server and one bridge):",
            "",
        ]
        lines += table(
            [
                "workers",
                "all in discovery s",
                "model at frontend s",
                "engine server MB",
                "bridge MB",
                "MB per worker",
                "MB per worker after refits",
            ],
            "rrrrrrr",
            [
                [
                    r.workers,
                    fmt(r.register_s, 2),
                    fmt(r.frontend_s, 2),
                    fmt(r.idle.engine_mb, 0),
                    fmt(r.idle.bridge_mb, 0),
                    fmt(r.idle.worker_mb, 0),
                    fmt(r.after_refits.worker_mb, 0),
                ]
                for r in self.rows
            ],
        )
        for n, why in sorted(self.skipped.items()):
            lines += ["", f"{n} workers: not measured, {why}."]
        if goals := self.goals():
            lines += ["", "Goals (issue 31):", "", *goal_table(goals)]
        return "\n".join([*lines, ""])


# -- measuring ------------------------------------------------------------------


def overlap(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(stage seconds, overlap) of calls given as (start, end): the first start to
    the last end, and the calls' summed durations over it."""
    if not intervals:
        return 0.0, float("nan")
    stage = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy = sum(e - s for s, e in intervals)
    return stage, busy / stage if stage > 0 else float("nan")


async def _timed(intervals: list[tuple[float, float]], call: Awaitable[int | None]) -> int | None:
    """``call``'s result, noting in ``intervals`` when it ran (also when it failed)."""
    started = time.monotonic()
    try:
        return await call
    finally:
        intervals.append((started, time.monotonic()))


class _TimedRoutes(RefitClient):
    """``RefitClient`` noting when each worker's update call ran."""

    intervals: list[tuple[float, float]]

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        return await _timed(self.intervals, super()._load(worker, source, expect))


class _TimedContract(EngineRefitClient):
    """``EngineRefitClient`` noting when each engine server's update call ran."""

    intervals: list[tuple[float, float]]

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        return await _timed(self.intervals, super()._load(worker, source, expect))


def _cpu_s(procs: Sequence[Proc]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = psutil.Process(proc.pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _memory(engines: Sequence[Proc], bridges: Sequence[Proc]) -> Memory:
    def rss_mb(procs: Sequence[Proc]) -> float:
        values = []
        for proc in procs:
            try:
                values.append(psutil.Process(proc.pid).memory_info().rss / MB)
            except psutil.Error:
                pass
        return median(values)

    return Memory(rss_mb(engines), rss_mb(bridges))


@dataclass
class _Workers:
    engines: list[Proc]
    bridges: list[Proc]
    addresses: list[str]
    urls: list[str]

    @property
    def procs(self) -> list[Proc]:
        return [*self.engines, *self.bridges]


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def _start(bench: Bench, n: int, checkpoint: Path, model: str, namespace: str) -> _Workers:
    """N engine servers (each on a port chosen here, so that its bridge starts at
    once and waits for it) and N bridges, all started without waiting."""
    workers = _Workers([], [], [], [])
    for i, port in enumerate(_free_ports(n)):
        address = f"127.0.0.1:{port}"
        proc, _ = bench.group.engine_server(
            f"fleet{n}-engine-{i}",
            "--model",
            str(checkpoint),
            "--served-model-name",
            model,
            "--seed",
            str(i),
            listen=address,
            ready_file=False,
        )
        workers.engines.append(proc)
        workers.addresses.append(address)
    for i, address in enumerate(workers.addresses):
        system_port = free_system_port()
        workers.bridges.append(
            bench.stack.start_bridge(
                f"fleet{n}-bridge-{i}",
                address,
                "--enable-rl",
                "--log-level",
                "warning",
                model=model,
                namespace=namespace,
                DYN_SYSTEM_PORT=str(system_port),
            )
        )
        workers.urls.append(f"http://127.0.0.1:{system_port}")
    return workers


def _registration(
    bench: Bench, workers: _Workers, n: int, model: str, namespace: str, started: float
) -> tuple[float, float]:
    """Seconds from ``started`` to all N in discovery, and to the model at the frontend."""
    seen: dict[str, float] = {}

    def check() -> bool:
        now = time.monotonic() - started
        if "discovery" not in seen and registered_workers(bench.stack.kv_dir, namespace) >= n:
            seen["discovery"] = now
        if "frontend" not in seen and model in served_models(bench.stack.base_url):
            seen["frontend"] = now
        return len(seen) == 2

    wait_until(check, 60 + 15 * n, f"{n} fleet workers registered", workers.procs, 0.05)
    return seen["discovery"], seen["frontend"]


async def _refits(
    workers: _Workers,
    checkpoints: Sequence[Path],
    tensors: Sequence[list[Tensor]],
    reps: int,
) -> dict[str, PathRuns]:
    """Every path once per repetition, in a rotating order, the first repetition a
    warm-up; each refit to the checkpoint the fleet does not serve."""
    n = len(workers.addresses)
    start = CommittedWeights("start", CheckpointSource(str(checkpoints[0])))
    routes = _TimedRoutes(workers.urls, committed=start)
    contract = _TimedContract(workers.addresses, committed=start)
    serving = 0
    runs = {p: PathRuns() for p in PATHS}
    try:
        for rep in range(reps + 1):
            for path in rotate(PATHS, rep):
                serving = 1 - serving
                version = f"n{n}-r{rep}-{path.split(',')[0]}"
                client = routes if path == DISK_ROUTES else contract
                client.intervals = []
                cpu = (time.process_time(), _cpu_s(workers.engines), _cpu_s(workers.bridges))
                t0 = time.perf_counter()
                if path == DISK_ROUTES:
                    await routes.refit(str(checkpoints[serving]), version)
                elif path == DISK_CONTRACT:
                    await contract.refit(version, path=str(checkpoints[serving]))
                else:
                    await contract.refit(version, tensors=tensors[serving])
                wall = time.perf_counter() - t0
                if not rep:
                    continue
                run = runs[path]
                stage, overlapped = overlap(client.intervals)
                run.wall_s.append(wall)
                run.update_s.append(stage)
                run.overlap.append(overlapped)
                run.trainer_cpu_s.append(time.process_time() - cpu[0])
                run.engine_cpu_s.append(_cpu_s(workers.engines) - cpu[1])
                run.bridge_cpu_s.append(_cpu_s(workers.bridges) - cpu[2])
                busy = run.trainer_cpu_s[-1] + run.engine_cpu_s[-1] + run.bridge_cpu_s[-1]
                run.machine_busy.append(busy / (wall * (os.cpu_count() or 1)))
                if path == STREAMED:
                    run.trainer_sent_mb = n * sum(t.nbytes for t in tensors[serving]) / MB
    finally:
        await routes.close()
        await contract.close()
    return runs


async def _fleet_row(
    bench: Bench,
    n: int,
    checkpoints: Sequence[Path],
    tensors: Sequence[list[Tensor]],
    reps: int,
) -> FleetRow:
    model, namespace = f"fleet-{n}", f"nsfleet{n}"
    started = time.monotonic()
    workers = _start(bench, n, checkpoints[0], model, namespace)
    try:
        with waiting(f"  {n} workers starting, registering"):
            register_s, frontend_s = _registration(bench, workers, n, model, namespace, started)
        idle = _memory(workers.engines, workers.bridges)
        runs = await _refits(workers, checkpoints, tensors, reps)
        after = _memory(workers.engines, workers.bridges)
    finally:
        for proc in workers.procs:  # all told at once, then waited for
            proc.signal(signal.SIGTERM)
        bench.stop(*workers.procs)
    row = FleetRow(n, register_s, frontend_s, idle, after, runs)
    say(
        f"  {n} workers: registered in {register_s:.1f}s, {idle.worker_mb:.0f} MB each; "
        + ", ".join(f"{p} {row.wall(p) * 1000:.0f} ms" for p in PATHS)
    )
    return row


def _frontend_up(bench: Bench) -> None:
    url = bench.start_frontend()
    wait_until(
        lambda: http_json(f"{url}/v1/models", timeout=5)[0] == 200,
        120,
        "the frontend answering",
        [bench.frontend()],
    )


def memory_short(workers: int, available_mb: float) -> str | None:
    """Why ``workers`` workers do not fit in ``available_mb`` (None: they do)."""
    need = workers * WORKER_BUDGET_MB + SPARE_MB
    if need <= available_mb:
        return None
    return (
        f"about {need / 1000:.1f} GB of memory needed "
        f"({WORKER_BUDGET_MB} MB per worker), {available_mb / 1000:.1f} GB available"
    )


async def run(bench: Bench, settings: FleetSettings | None = None) -> Fleet:
    settings = settings or FleetSettings()
    quick = bench.options.quick
    mb = settings.mb or (QUICK_MB if quick else DEFAULT_MB)
    reps = settings.reps or (1 if quick else DEFAULT_REPS)
    say(f"part 9: a fleet of {', '.join(map(str, settings.sizes))} sim workers, {mb} MB refits")
    checkpoints = [
        synthetic_model(bench.model_dir, bench.root / f"fleet-{mb}mb-{seed}", mb, seed)
        for seed in (0, 1)
    ]
    tensors = [checkpoint_tensors(c) for c in checkpoints]
    _frontend_up(bench)
    rows, skipped = [], {}
    for n in settings.sizes:
        why = memory_short(n, psutil.virtual_memory().available / MB)
        if why is not None:
            say(f"  {n} workers: left out, {why}")
            skipped[n] = why
            continue
        rows.append(await _fleet_row(bench, n, checkpoints, tensors, reps))
    return Fleet(sum(t.nbytes for t in tensors[0]) / MB, reps, rows, skipped)
