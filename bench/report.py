"""Markdown for bench.md: what every part's table is made of."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from bench.stats import Summary, median


class PartResult(Protocol):
    """What a part returns: a dataclass (bench.json holds it as is) that renders
    its own section of bench.md."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def render(self) -> str: ...


@dataclass(frozen=True)
class Goal:
    """One of an issue's targets next to what this run measured."""

    what: str
    target: str
    measured: str
    met: bool

    @classmethod
    def at_least(cls, what: str, measured: float, target: float, unit: str = "") -> Goal:
        return cls(what, f">= {target:g}{unit}", f"{measured:.2f}{unit}", measured >= target)

    @classmethod
    def at_most(
        cls, what: str, measured: float, target: float, unit: str = "", sign: bool = False
    ) -> Goal:
        shown = f"{measured:+.2f}" if sign else f"{measured:.2f}"
        return cls(what, f"<= {target:g}{unit}", f"{shown}{unit}", measured <= target)


@runtime_checkable
class HasGoals(Protocol):
    """A part that measures against goals (bench.md sums them up at its top)."""

    def goals(self) -> list[Goal]: ...


# Issue 15: the hop adds at most this much to the p50 of one request at a time.
GOAL_ADDED_P50_MS_C1 = 1.0


def added_p50_at_c1(
    one_process: Mapping[int, Summary],
    split: Mapping[str, Mapping[int, Summary]],
    labels: Mapping[str, str],
) -> list[Goal]:
    """The c=1 latency goal of each configuration in ``split`` (none when c=1 was
    not measured)."""
    if 1 not in one_process:
        return []
    base = one_process[1].p50_ms
    return [
        Goal.at_most(
            f"p50 added at c=1, {labels[name]}",
            per[1].p50_ms - base,
            GOAL_ADDED_P50_MS_C1,
            " ms",
            sign=True,
        )
        for name, per in split.items()
    ]


def goal_table(goals: Sequence[Goal]) -> list[str]:
    rows = [[g.what, g.target, g.measured, "met" if g.met else "**not met**"] for g in goals]
    return table(["goal", "target", "measured", ""], "lrrl", rows)


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def table(header: Sequence[str], align: str, rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table; ``align`` has one letter per column: ``l`` or ``r``."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def paired(a: Summary, b: Summary) -> str:
    """Median [min-max] of the per-repetition rps ratios b/a."""
    pairs = zip(a.rps_reps, b.rps_reps, strict=True)
    ratios = [rb / ra for ra, rb in pairs if ra]
    if not ratios:
        return ""
    return f"{median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


Figure = tuple[str, Callable[[Summary], str]]
Difference = tuple[str, Callable[[Summary, Summary], str]]

# The figures the parts' tables show of each configuration.
RPS: Figure = ("rps", lambda x: fmt(x.rps))
P50_MS: Figure = ("p50 ms", lambda x: fmt(x.p50_ms, 2))
P99_MS: Figure = ("p99 ms", lambda x: fmt(x.p99_ms, 2))
TTFT_P50_MS: Figure = ("TTFT p50 ms", lambda x: fmt(x.ttft_p50_ms, 2))


def one_process_vs_split_table(
    summaries: Mapping[str, Mapping[int, Summary]],
    one_process: str,
    transports: Mapping[str, str],
    concurrency: Sequence[int],
    figures: Sequence[Figure],
    differences: Sequence[Difference],
) -> list[str]:
    """A part's (a)-vs-(b) table: per concurrency and transport, the concurrency,
    (a)'s ``figures`` (name, value), the transport's label, (b)'s ``figures``, the
    rps ratio (b)/(a) and its per-repetition pairs, then the ``differences``
    (name, value of a and b)."""
    header = [
        "conc",
        *(f"(a) {name}" for name, _ in figures),
        "(b) transport",
        *(f"(b) {name}" for name, _ in figures),
        "rps (b)/(a)",
        "paired",
        *(name for name, _ in differences),
    ]
    align = "r" * (1 + len(figures)) + "l" + "r" * (len(figures) + 1) + "l"
    align += "r" * len(differences)
    rows: list[list[object]] = []
    for c in concurrency:
        a = summaries[one_process][c]
        for transport, label in transports.items():
            b = summaries[transport][c]
            rows.append(
                [
                    c,
                    *(value(a) for _, value in figures),
                    label,
                    *(value(b) for _, value in figures),
                    f"**{b.rps / a.rps:.2f}**",
                    paired(a, b),
                    *(value(a, b) for _, value in differences),
                ]
            )
    return table(header, align, rows)


def goals_and_failures(
    goals: Sequence[Goal], summaries: Mapping[str, Mapping[int, Summary]]
) -> list[str]:
    """The goals' table, then how many requests failed in all (not in the figures)."""
    errors = sum(r.errors for per in summaries.values() for r in per.values())
    return [
        "",
        "Goals (issue 15):",
        "",
        *goal_table(goals),
        "",
        f"Failed requests (not counted above): {errors}.",
        "",
    ]


# The columns of ``cpu_cells``.
CPU_HEADER = ("frontend", "worker / bridge", "engine server", "load generator", "total")


def cpu_cells(cpu: Mapping[str, float]) -> list[str]:
    """CPU milliseconds per request by process (``CPU_HEADER``): the frontend, the
    worker or bridge, the engine server (its child processes included), the load
    generator, and all of them."""
    worker = sum(v for k, v in cpu.items() if k.startswith(("worker", "bridge")))
    return [
        f"{cpu.get('frontend', 0):.2f}",
        f"{worker:.2f}",
        f"{cpu.get('engine', 0) + cpu.get('engine-children', 0):.2f}",
        f"{cpu.get('client', 0):.2f}",
        f"{sum(cpu.values()):.2f}",
    ]


def cpu_table(
    summaries: Mapping[str, Mapping[int, Summary]],
    labels: Mapping[str, str],
    concurrency: Sequence[int],
    figures: Sequence[Figure] = (),
) -> list[str]:
    """Per concurrency and configuration (``labels``: name -> its label, in order),
    CPU milliseconds per request by process (``cpu_cells``), then ``figures``; a
    configuration without CPU figures is left out."""
    rows: list[list[object]] = []
    for c in concurrency:
        for name, label in labels.items():
            summary = summaries[name][c]
            if summary.cpu_ms:
                values = (value(summary) for _, value in figures)
                rows.append([c, label, *cpu_cells(summary.cpu_ms), *values])
    header = ["conc", "config", *CPU_HEADER, *(name for name, _ in figures)]
    return table(header, "rl" + "r" * (len(header) - 2), rows)
