"""Configurations measured side by side: repetitions interleaved, CPU time per
request charged to each serving process by its role."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import psutil

from bench.stats import Cell, rotate
from harness.procs import Proc
from harness.progress import counting

# CPU time of the load generator: this process.
CLIENT = "client"


@dataclass(frozen=True)
class Config:
    """One configuration: how to measure ``n`` requests at a concurrency, and the
    processes serving them (besides this one), whose CPU time is charged to it."""

    name: str
    serving: Sequence[Proc]
    measure: Callable[[int, int], Awaitable[Cell]]  # (concurrency, n) -> cell


def cpu_seconds(serving: Sequence[Proc]) -> dict[str, float]:
    """CPU seconds so far of this process (``client``) and of each serving process,
    keyed by role; a role's child processes apart as ``<role>-children`` (vLLM's
    EngineCore is a child of its engine server)."""
    mine = psutil.Process().cpu_times()
    out = {CLIENT: mine.user + mine.system}
    for proc in serving:
        role = proc.role.value
        try:
            p = psutil.Process(proc.pid)
            t = p.cpu_times()
            out[role] = out.get(role, 0.0) + t.user + t.system
            children = 0.0
            for child in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = child.cpu_times()
                    children += t.user + t.system
            if children:
                out[f"{role}-children"] = out.get(f"{role}-children", 0.0) + children
        except psutil.Error:
            out.setdefault(role, 0.0)
    return out


async def measure_cpu(config: Config, concurrency: int, n: int) -> Cell:
    """``config.measure``, with the CPU milliseconds per request of every process."""
    before = cpu_seconds(config.serving)
    cell = await config.measure(concurrency, n)
    after = cpu_seconds(config.serving)
    cell.cpu_ms = {k: (after[k] - before.get(k, 0.0)) * 1000 / max(cell.n, 1) for k in after}
    return cell


async def interleaved(
    configs: Sequence[Config],
    concurrencies: Sequence[int],
    reps: int,
    n_for: Callable[[int], int],
    progress: Callable[[str], None],
) -> dict[str, dict[int, list[Cell]]]:
    """Each concurrency in turn: ``reps`` repetitions, each measuring every
    configuration once, in an order that rotates by one per repetition, so that
    drifts in the machine's other load hit all configurations alike."""
    cells: dict[str, dict[int, list[Cell]]] = {
        config.name: {c: [] for c in concurrencies} for config in configs
    }
    # A bar over every measurement, with elapsed and remaining time (terminal only).
    bar = counting("  measuring", len(concurrencies) * reps * len(configs), unit="run")
    for c in concurrencies:
        for rep in range(reps):
            for config in rotate(configs, rep):
                bar.set_postfix_str(f"c={c} {config.name}", refresh=False)
                cells[config.name][c].append(await measure_cpu(config, c, n_for(c)))
                bar.update()
            with bar.external_write_mode():
                progress(
                    f"  c={c} rep {rep + 1}/{reps}: "
                    + ", ".join(
                        f"{name} {per[c][-1].rps:.1f}/s p50 {per[c][-1].p50_ms:.2f}ms"
                        for name, per in cells.items()
                    )
                )
    bar.close()
    return cells
