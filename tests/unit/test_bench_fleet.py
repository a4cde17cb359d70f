"""Part 9 of the bench ("fleet"): issue 31's goals (the disk refit of 8 workers
within 2x of one worker's, its updates running at once), the overlap figure,
the tables, the memory check, and the part chosen by name. No processes."""

import json
from dataclasses import asdict

import pytest

from bench.__main__ import PARTS, goals_line, parse_part
from bench.fleet import (
    DISK_CONTRACT,
    DISK_ROUTES,
    STREAMED,
    Fleet,
    FleetRow,
    Memory,
    PathRuns,
    memory_short,
    overlap,
)


def _row(n: int, disk_s: float, overlapped: float, streamed_s: float = 1.0) -> FleetRow:
    def runs(wall: float, sent: float = 0.0) -> PathRuns:
        return PathRuns(
            wall_s=[wall, wall * 1.2, wall * 0.9],
            update_s=[wall * 0.9] * 3,
            overlap=[overlapped] * 3,
            trainer_cpu_s=[0.01] * 3,
            engine_cpu_s=[0.2 * n] * 3,
            bridge_cpu_s=[0.01 * n] * 3,
            trainer_sent_mb=sent,
            machine_busy=[0.95] * 3,
        )

    return FleetRow(
        n,
        register_s=0.6 * n,
        frontend_s=0.5,
        idle=Memory(57.0, 120.0),
        after_refits=Memory(80.0, 121.0),
        paths={
            DISK_ROUTES: runs(disk_s),
            DISK_CONTRACT: runs(disk_s),
            STREAMED: runs(streamed_s * n, 268.4 * n),
        },
    )


def test_the_goals_compare_eight_workers_with_one() -> None:
    part = Fleet(268.4, 3, [_row(1, 0.2, 1.0), _row(2, 0.25, 2.0), _row(8, 0.35, 7.6)])
    goals = {g.what: g for g in part.goals()}
    assert list(goals) == [
        "disk refit (RL routes), 8 workers over 1",
        "disk updates running at once, 8 workers",
    ]
    ratio = goals["disk refit (RL routes), 8 workers over 1"]
    assert ratio.met and ratio.measured == "1.75x" and ratio.target == "<= 2x"
    assert goals["disk updates running at once, 8 workers"].met
    line = goals_line({9: part})
    assert line is not None and line.startswith("**Goals: 2 of 2 met in this run** (part 9;")


def test_a_slow_or_serial_fan_out_misses_its_goal() -> None:
    slow = Fleet(268.4, 3, [_row(1, 0.2, 1.0), _row(8, 0.9, 7.7)])
    assert [g.met for g in slow.goals()] == [False, True]
    assert slow.goals()[0].measured == "4.50x"
    serial = Fleet(268.4, 3, [_row(1, 0.2, 1.0), _row(8, 0.3, 1.1)])
    assert [g.met for g in serial.goals()] == [True, False]
    line = goals_line({9: serial})
    assert line is not None and "not met: part 9, disk updates running at once" in line


def test_no_goal_without_both_sizes_and_a_missing_path_misses_it() -> None:
    assert Fleet(268.4, 3, [_row(2, 0.2, 2.0), _row(4, 0.3, 4.0)]).goals() == []
    assert goals_line({9: Fleet(268.4, 3, [_row(1, 0.2, 1.0)])}) is None
    unmeasured = _row(8, 0.3, 8.0)
    del unmeasured.paths[DISK_ROUTES]
    part = Fleet(268.4, 3, [_row(1, 0.2, 1.0), unmeasured])
    assert [(g.met, g.measured) for g in part.goals()] == [(False, "infx"), (False, "0.00")]


def test_the_tables_show_each_size_and_path_and_what_was_left_out() -> None:
    part = Fleet(268.4, 3, [_row(1, 0.2, 1.0), _row(8, 0.35, 7.6)], {16: "too little memory"})
    text = part.render()
    assert "## 9. A fleet of sim workers" in text
    # median wall 0.2 s; vs N=1; overlap; engine CPU per worker 200 ms
    assert "| 1 | disk, RL routes | 200 | 1.00 | 180 | 1.0 |  | 10 | 200 | 10 | 95% |" in text
    assert "| 8 | streamed, contract | 8,000 | 8.00 |" in text and "| 2,147 |" in text
    assert "| 8 | 4.80 | 0.50 | 57 | 120 | 177 | 201 |" in text
    assert "16 workers: not measured, too little memory." in text
    assert "Goals (issue 31):" in text
    json.dumps(asdict(part))  # bench.json holds it as is


def test_overlap_is_one_for_calls_in_turn_and_n_for_calls_at_once() -> None:
    assert overlap([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == (3.0, 1.0)
    stage, at_once = overlap([(0.0, 2.0), (0.1, 2.0), (0.0, 1.9), (0.1, 1.9)])
    assert stage == 2.0 and at_once == pytest.approx(3.8)
    assert overlap([])[0] == 0.0


def test_a_size_runs_only_where_memory_holds_it() -> None:
    assert memory_short(8, 23_000) is None
    why = memory_short(16, 9_000)
    assert why is not None and "9.0 GB available" in why


def test_parts_are_chosen_by_number_or_name() -> None:
    assert parse_part("fleet") == 9 and parse_part(" 6") == 6 and 9 in PARTS
    with pytest.raises(ValueError, match="fleet"):
        parse_part("fleets")
