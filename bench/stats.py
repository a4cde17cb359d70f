"""Closed-loop load and the numbers the bench reports."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Cell:
    """One measurement: ``n`` requests at concurrency ``c``."""

    config: str
    concurrency: int
    n: int
    seconds: float
    latencies_s: list[float] = field(repr=False)
    errors: int = 0
    # CPU milliseconds per request, by process role (when measured).
    cpu_ms: dict[str, float] = field(default_factory=dict)
    # Time to the first token of each streamed request (when ``send`` reports it).
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    # Token-carrying events per streamed request, as the client saw them (when counted).
    events_per_request: float = float("nan")

    @property
    def rps(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else 0.0

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_s, 50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_s, 99) * 1000

    @property
    def ttft_p50_ms(self) -> float:
        return percentile(self.ttfts_s, 50) * 1000


@dataclass
class Summary:
    """Medians over the repetitions of one (configuration, concurrency)."""

    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    # CPU milliseconds per request by process role ("client": this process;
    # "<role>-children": the role's child processes, vLLM's EngineCore).
    cpu_ms: dict[str, float]
    reps: int
    # Per repetition, in order, for ratios paired within a repetition.
    rps_reps: list[float]
    # Median time to first token (streamed requests; NaN otherwise).
    ttft_p50_ms: float = float("nan")
    # Median of the cells' token-carrying events per streamed request (NaN: not counted).
    events_per_request: float = float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rotate(items: Sequence[T], k: int) -> list[T]:
    """``items`` starting at ``k`` (mod its length): the order of repetition ``k``."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


async def closed_loop(
    config: str,
    send: Callable[[int], Awaitable[object]],
    concurrency: int,
    n: int,
) -> Cell:
    """``n`` calls of ``send(i)``, ``concurrency`` at a time; latency of each, and
    the time to first token when ``send`` returns it (seconds, a float)."""
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    next_index = 0

    async def worker() -> None:
        nonlocal next_index, errors
        while next_index < n:
            i = next_index
            next_index += 1
            started = time.perf_counter()
            try:
                ttft = await send(i)
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            if isinstance(ttft, float):
                ttfts.append(ttft)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    seconds = time.perf_counter() - started
    if errors and not latencies:
        # Surface the failure instead of reporting zeros.
        await send(0)
    return Cell(config, concurrency, n - errors, seconds, latencies, errors, ttfts_s=ttfts)


def summarize(cells: Sequence[Cell]) -> Summary:
    """Medians over repetitions of one (config, concurrency)."""
    return Summary(
        rps=median([c.rps for c in cells]),
        p50_ms=median([c.p50_ms for c in cells]),
        p99_ms=median([c.p99_ms for c in cells]),
        errors=sum(c.errors for c in cells),
        cpu_ms={
            k: median([c.cpu_ms.get(k, 0.0) for c in cells])
            for k in sorted({k for c in cells for k in c.cpu_ms})
        },
        reps=len(cells),
        rps_reps=[c.rps for c in cells],
        ttft_p50_ms=median([c.ttft_p50_ms for c in cells if c.ttfts_s])
        if any(c.ttfts_s for c in cells)
        else float("nan"),
        events_per_request=median(
            [c.events_per_request for c in cells if not math.isnan(c.events_per_request)]
        ),
    )
