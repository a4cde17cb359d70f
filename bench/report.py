"""Markdown for bench.md: what every part's table is made of."""

from __future__ import annotations

from collections.abc import Sequence
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
