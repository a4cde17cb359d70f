"""The work units the suite's xdist runs hand out, and their order: heaviest first.

``make test`` runs suites on two workers, a work unit (a file, or a folder of
``ONE_WORK_UNIT``) at a time. pytest-xdist hands units out in order of their
test count, so a long file with few tests (a GRPO run on a Ray fleet: two tests,
two minutes) could start last and end the run with one worker idle while the
other finished it: measured, a 416 s e2e run whose workers had 403 s and 311 s
of tests. Handed out longest first (``UNIT_SECONDS``, each unit's seconds from
an earlier run on two cores), the same suite took 341 s against 377 s in xdist's
order, run back to back. A unit not in the file counts as a median one.

Refresh the figures with ``--record-unit-seconds`` on any run: each unit's
set-up, call and teardown seconds are merged into the file.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

# Folders whose files share session-scoped, parametrized servers (the conformance
# suite's engine servers, one per kind). pytest orders a session's tests so that each
# server starts once; on xdist workers, a file per work unit, every file started them
# all again (the vLLM one: eleven start-ups instead of one, about 24 CPU-seconds
# each). Each such folder is one work unit instead, run in pytest's order on one worker.
ONE_WORK_UNIT = ("tests/conformance/",)

UNIT_SECONDS = Path(__file__).with_name("unit_seconds.json")


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its ``ONE_WORK_UNIT`` folder, else its file."""
    for folder in ONE_WORK_UNIT:
        if nodeid.startswith(folder):
            return folder
    return nodeid.split("::", 1)[0]


def read_seconds(path: Path = UNIT_SECONDS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(unit): float(seconds) for unit, seconds in data.items()}


def heaviest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """``items`` with their units longest first; a unit's own items keep their order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(unit_of(item.nodeid), len(first_seen))
    median = statistics.median(seconds.values()) if seconds else 0.0

    def key(item: pytest.Item) -> tuple[float, int]:
        unit = unit_of(item.nodeid)
        return (-seconds.get(unit, median), first_seen[unit])

    return sorted(items, key=key)


class UnitClock:
    """Sums each unit's phase durations over a run, then merges them into the file
    (``--record-unit-seconds``); under xdist, on the controller, which sees every
    worker's reports."""

    def __init__(self, path: Path = UNIT_SECONDS) -> None:
        self.path = path
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[unit_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        merged = read_seconds(self.path) | {u: round(s, 1) for u, s in self.seconds.items()}
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
