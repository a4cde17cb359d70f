"""The soak's per-process figures that tell a one-time RSS step from a leak: the
largest step between two samples and when."""

from __future__ import annotations

from scripts.soak import rss_figures

MIB = 2**20


def test_the_largest_step_and_its_time_are_reported() -> None:
    samples = [(t / 2, (100 + (53 if t >= 41 else 0) + t % 3) * MIB) for t in range(120)]
    figures = rss_figures(samples, duration=60, warmup=6, window=12)
    assert figures["largest_step_mib"] == 54.0  # 101 MiB at 20 s, 155 at 20.5 s
    assert figures["largest_step_at_s"] == 20.5
    assert figures["growth_pct"] > 40
