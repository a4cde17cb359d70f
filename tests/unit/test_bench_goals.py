"""The bench's goals: each part's table and the line at the top of bench.md say
which of issue 15's targets a run met, and a measurement that is missing (NaN)
never counts as met."""

import math

from bench.__main__ import goals_line
from bench.frontend_rollouts import FrontendRollouts
from bench.report import Goal
from bench.stats import Summary
from bench.streaming import Streaming


def _summary(
    rps: float, p50_ms: float, ttft_ms: float = math.nan, bridge_ms: float = 1.0
) -> Summary:
    return Summary(rps, p50_ms, p50_ms * 2, 0, {"bridge": bridge_ms}, 1, [rps], ttft_ms)


def _streaming(tcp_rps_c64: float, unix_ttft_c16: float) -> Streaming:
    one = {c: _summary(100.0, 10.0, 10.0) for c in (1, 16, 64)}
    tcp = {
        1: _summary(90.0, 10.5, 11.0),
        16: _summary(95.0, 11.0, 11.0),
        64: _summary(tcp_rps_c64, 11.0, 11.0),
    }
    unix = {
        1: _summary(90.0, 12.0, 11.0),
        16: _summary(95.0, 11.0, unix_ttft_c16),
        64: _summary(95.0, 11.0, 11.0),
    }
    other = {c: _summary(50.0, 20.0, 20.0, 9.0) for c in (1, 16, 64)}
    return Streaming(
        {
            "sinproc": one,
            "sgrpc-tcp": tcp,
            "sgrpc-unix": unix,
            "sunary-tcp": other,
            "sgrpc-unpaced": other,
        }
    )


def test_streaming_goals_name_each_target_and_say_whether_it_was_met() -> None:
    goals = {g.what: g for g in _streaming(tcp_rps_c64=80.0, unix_ttft_c16=12.0).goals()}
    # rps, TTFT and bridge CPU at c=16 and 64 over both streams, and c=1's added latency.
    assert len(goals) == 14
    assert not goals["rps (b)/(a) at c=64, stream, tcp"].met
    assert goals["rps (b)/(a) at c=64, stream, tcp"].measured == "0.80"
    assert goals["rps (b)/(a) at c=16, stream, tcp"].met
    assert not goals["TTFT p50 (b)/(a) at c=16, stream, unix"].met
    assert goals["bridge CPU per request at c=64, stream, tcp"].met
    assert goals["p50 added at c=1, stream, tcp"].measured == "+0.50 ms"
    assert not goals["p50 added at c=1, stream, unix"].met  # +2 ms
    # The variants measured beside the streams are not held to the goals.
    assert not any("one call each" in what or "unpaced" in what for what in goals)


def test_a_missing_measurement_is_not_met() -> None:
    assert not Goal.at_most("x", math.nan, 1.0).met
    assert not Goal.at_least("x", math.nan, 1.0).met
    goals = {g.what: g for g in _streaming(90.0, math.nan).goals()}
    assert not goals["TTFT p50 (b)/(a) at c=16, stream, unix"].met


def test_the_top_line_counts_the_goals_of_every_part_and_names_the_missed_ones() -> None:
    rollouts = FrontendRollouts(
        {
            "inproc": {c: _summary(100.0, 2.0) for c in (1, 64)},
            "grpc-tcp": {1: _summary(90.0, 2.5), 64: _summary(96.0, 50.0)},
            "grpc-unix": {1: _summary(90.0, 2.4), 64: _summary(99.0, 50.0)},
            "unary-tcp": {c: _summary(50.0, 5.0) for c in (1, 64)},
        }
    )
    assert [g.met for g in rollouts.goals()] == [True, False, True, True]
    line = goals_line({1: rollouts, 7: _streaming(95.0, 11.0)})
    assert line is not None
    assert line.startswith("**Goals: 16 of 18 met in this run** (parts 1 and 7;")
    assert "part 1, rps (b)/(a) at c=64, stream, unix (0.99)" in line
    assert "part 7, p50 added at c=1, stream, unix (+2.00 ms)" in line
    assert goals_line({}) is None
