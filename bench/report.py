"""Markdown for bench.md: what every part's table is made of."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
