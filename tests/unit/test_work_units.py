"""tests/work_units.py: the xdist runs' work units go out longest first, a unit's
own tests in their order, and a run with --record-unit-seconds merges its figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests import work_units

ROOT = Path(__file__).resolve().parents[2]


def items(*nodeids: str) -> list[Any]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_units_go_longest_first_and_keep_their_own_order() -> None:
    seconds = {"tests/a.py": 5.0, "tests/b.py": 100.0, "tests/conformance/": 50.0}
    given = items(
        "tests/a.py::t1",
        "tests/conformance/test_x.py::t[sim]",
        "tests/b.py::t2",
        "tests/conformance/test_y.py::t[sim]",
        "tests/b.py::t1",
        "tests/a.py::t2",
    )
    ordered = [i.nodeid for i in work_units.heaviest_first(given, seconds)]
    assert ordered == [
        "tests/b.py::t2",
        "tests/b.py::t1",
        "tests/conformance/test_x.py::t[sim]",
        "tests/conformance/test_y.py::t[sim]",
        "tests/a.py::t1",
        "tests/a.py::t2",
    ]


def test_a_unit_with_no_figure_counts_as_a_median_one() -> None:
    seconds = {"tests/a.py": 10.0, "tests/b.py": 20.0, "tests/c.py": 30.0}
    given = items("tests/a.py::t", "tests/new.py::t", "tests/c.py::t", "tests/b.py::t")
    ordered = [i.nodeid for i in work_units.heaviest_first(given, seconds)]
    # The new file ties with b (the median, 20 s) and came first in the collection.
    assert ordered == ["tests/c.py::t", "tests/new.py::t", "tests/b.py::t", "tests/a.py::t"]


def test_every_unit_of_the_file_exists() -> None:
    for unit in work_units.read_seconds():
        assert (ROOT / unit).exists(), f"{unit} is in tests/unit_seconds.json but not in tests/"


def test_a_recorded_run_merges_its_units_into_the_file(tmp_path: Path) -> None:
    figures = tmp_path / "seconds.json"
    figures.write_text(json.dumps({"tests/other.py": 7.0, "tests/a.py": 1.0}))
    clock = work_units.UnitClock(figures)
    for nodeid, duration in (
        ("tests/a.py::t", 0.5),
        ("tests/a.py::t", 2.0),
        ("tests/b.py::t", 3.0),
    ):
        clock.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))  # type: ignore[arg-type]
    clock.pytest_sessionfinish()
    assert json.loads(figures.read_text()) == {
        "tests/a.py": 2.5,
        "tests/b.py": 3.0,
        "tests/other.py": 7.0,
    }
