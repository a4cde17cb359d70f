"""Where a command's CPU goes: by kind of process and by the test that started it.

    python -m scripts.cpu_by_test [--out FILE] [--top 25] -- make test

Runs the command and, every half second, every process on the machine that
started after it: its command line, its name (vLLM renames its EngineCore), its
CPU-seconds (user and system), and, read from its environment when first seen,
``PYTEST_CURRENT_TEST``, which a pytest process sets during each test's set-up,
call and teardown and every process it starts inherits. A process's last sample
stands for its whole life: one that lives under half a second is missed, and one
loses at most its last half second. The exit status is the command's.

Prints the CPU-seconds by kind and by test file; ``--out`` keeps every process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from harness.waits import Sampler

PERIOD_S = 0.5

# First match wins: (kind, pattern over "NAME CMDLINE").
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("vLLM EngineCore", r"EngineCor"),
        ("vLLM model registry probe", r"-m vllm\.model_executor\.models\.registry"),
        ("vLLM's own server", r"-m vllm\.entrypoints"),
        ("engine server (vLLM)", r"-m engine_server .*--backend vllm"),
        ("engine server (other)", r"-m engine_server\b"),
        # The worker launcher's first engine server: the child that listed its flags.
        ("engine server (vLLM)", r"-m engine_worker\.flags engine vllm --serve"),
        ("engine server (other)", r"-m engine_worker\.flags engine \S+ --serve"),
        ("worker flag listing", r"-m engine_worker\.flags"),
        ("worker launcher", r"-m engine_worker\b"),
        ("bridge", r"-m bridge\b"),
        ("Dynamo frontend", r"-m dynamo\.frontend"),
        ("Ray", r"/ray/|ray::|raylet|gcs_server"),
        ("pytest", r"-m pytest\b|import sys;exec\(eval|\[pytest-xdist"),
        ("pip", r"/pip |-m pip\b"),
        ("lint", r"mypy|ruff|/buf |node "),
        ("etcd, NATS", r"etcd|nats-server"),
    )
)


@dataclass
class Process:
    pid: int
    started: float
    command: str
    name: str
    test: str
    cpu_s: float
    last_seen: float


def kind_of(name: str, command: str) -> str:
    """The kind a process counts under; its first word where no kind matches."""
    text = f"{name} {command}"
    for kind, pattern in KINDS:
        if pattern.search(text):
            return kind
    return "other: " + (command.split()[0].rsplit("/", 1)[-1] if command else name)


def file_of_test(test: str) -> str:
    """``tests/x.py::test_y (call)`` -> ``tests/x.py``; "" for none."""
    return test.split("::", 1)[0]


def tally(
    processes: Iterable[Process], key: Callable[[Process], str], counts: Callable[[Process], bool]
) -> dict[str, tuple[int, float]]:
    """Key -> (processes that ``counts``, CPU-seconds of all)."""
    totals: dict[str, tuple[int, float]] = defaultdict(lambda: (0, 0.0))
    for p in processes:
        count, cpu = totals[key(p)]
        totals[key(p)] = (count + counts(p), cpu + p.cpu_s)
    return dict(totals)


def by_kind(processes: Iterable[Process]) -> dict[str, tuple[int, float]]:
    """Kind -> (processes, CPU-seconds)."""
    return tally(processes, lambda p: kind_of(p.name, p.command), lambda p: True)


def by_test_file(processes: Iterable[Process]) -> dict[str, tuple[int, float]]:
    """Test file ("" for processes no test started) -> (vLLM EngineCores, CPU-seconds)."""
    return tally(
        processes,
        lambda p: file_of_test(p.test),
        lambda p: kind_of(p.name, p.command) == "vLLM EngineCore",
    )


class ProcessTable:
    """Every process started at or after ``since``, but this one, as last sampled."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.seen: dict[tuple[int, float], Process] = {}

    def sample(self) -> None:
        now = time.time()
        for proc in psutil.process_iter(["pid", "create_time", "name"]):
            started = proc.info["create_time"]
            if started < self.since or proc.pid == os.getpid():
                continue
            try:
                times = proc.cpu_times()
                key = (proc.pid, started)
                known = self.seen.get(key)
                if known is None:
                    self.seen[key] = Process(
                        pid=proc.pid,
                        started=started,
                        command=" ".join(proc.cmdline())[:400],
                        name=proc.info["name"],
                        test=proc.environ().get("PYTEST_CURRENT_TEST", ""),
                        cpu_s=times.user + times.system,
                        last_seen=now,
                    )
                else:  # an exec since (a fork is first seen with its parent's)
                    known.cpu_s = times.user + times.system
                    known.last_seen = now
                    known.name = proc.name()
                    known.command = " ".join(proc.cmdline())[:400]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue


def table(title: str, rows: dict[str, tuple[int, float]], count: str, top: int) -> str:
    ordered = sorted(rows.items(), key=lambda row: -row[1][1])
    lines = [f"| {title} | {count} | CPU-s |", "|---|---|---|"]
    lines += [f"| {key or '(no test)'} | {n} | {cpu:.0f} |" for key, (n, cpu) in ordered[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write every process sampled here (JSON)")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    started = time.time()
    processes_seen = ProcessTable(since=started - 1)
    with Sampler(processes_seen.sample, interval_s=PERIOD_S, on_close=processes_seen.sample):
        status = subprocess.call(command)
    wall = time.time() - started
    processes = list(processes_seen.seen.values())
    total = sum(p.cpu_s for p in processes)
    print(f"\n{wall:.0f} s, {total:.0f} CPU-seconds in {len(processes)} processes")
    print(table("kind", by_kind(processes), "processes", args.top))
    print()
    print(table("test file", by_test_file(processes), "vLLM EngineCores", args.top))
    if args.out:
        args.out.write_text(json.dumps([asdict(p) for p in processes], indent=1))
    sys.exit(status)


if __name__ == "__main__":
    main()
