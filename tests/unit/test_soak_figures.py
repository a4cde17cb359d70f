"""The soak's per-process figures that tell a one-time RSS step from a leak: the
largest step between two samples and when, and when the process first logged a
Rust stack backtrace."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from scripts.soak import first_rust_backtrace_s, rss_figures

MIB = 2**20


def test_the_largest_step_and_its_time_are_reported() -> None:
    samples = [(t / 2, (100 + (53 if t >= 41 else 0) + t % 3) * MIB) for t in range(120)]
    figures = rss_figures(samples, duration=60, warmup=6, window=12)
    assert figures["largest_step_mib"] == 54.0  # 101 MiB at 20 s, 155 at 20.5 s
    assert figures["largest_step_at_s"] == 20.5
    assert figures["growth_pct"] > 40


def test_the_first_backtrace_is_timed_by_the_line_before_it(tmp_path: Path) -> None:
    started = dt.datetime(2026, 12, 7, 1, 12, 0, tzinfo=dt.UTC).timestamp()
    log = tmp_path / "bridge-0.log"
    log.write_text(
        "\x1b[2m2026-12-07T01:12:04.666173Z\x1b[0m \x1b[32m INFO\x1b[0m request received\n"
        "\x1b[2m2026-12-07T01:12:54.954948Z\x1b[0m \x1b[31mERROR\x1b[0m writer task returned"
        " error err=I/O error: Broken pipe (os error 32)\n"
        "\n"
        "Caused by:\n"
        "    Broken pipe (os error 32)\n"
        "\n"
        "Stack backtrace:\n"
        "   0: anyhow::error::<impl anyhow::Error>::msg\n"
        "\x1b[2m2026-12-07T01:12:58.000000Z\x1b[0m \x1b[31mERROR\x1b[0m another\n"
        "Stack backtrace:\n"
    )
    assert first_rust_backtrace_s(log, started) == 55.0


def test_no_backtrace_and_no_log_read_as_none(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("2026-12-07 01:12:04,666 INFO engine_server: listening\n")
    assert first_rust_backtrace_s(log, 0.0) is None
    assert first_rust_backtrace_s(tmp_path / "missing.log", 0.0) is None
