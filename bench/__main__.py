"""``make bench``: the gRPC hop's cost, measured side by side in one run.

    python -m bench [--parts 4,1,7,2,3,5,6,8,9] [--reps 5] [--quick] [--out bench-results]
                    [--aiperf .aiperf/bin/aiperf] [--fleet-sizes 1,2,4,8,16] [--fleet-mb 256]

1. Rollouts through Dynamo's frontend at concurrency 1/16/64/256: (a) a Dynamo
   worker serving the simulated engine in its own process, (b) bridge + engine
   server over gRPC on TCP and on a unix socket (``bench/frontend_rollouts.py``).
2. The gRPC hop alone: Rollout RPCs straight to the engine server, next to the
   same engine code called in this process (``bench/hop.py``).
3. A 16k-token rollout with routed experts (48 layers, top-8, uint8)
   (``bench/large_rollout.py``).
4. KV events: what the relay sustains into Dynamo's publisher, and the latency
   (``bench/kv_events.py``).
5. The vLLM engine server (CPU, tiny model) through the whole stack next to
   ``AsyncLLM`` called directly (``bench/vllm_stack.py``).
6. The refit cycle: pause -> update -> resume, weights streamed over TCP and a
   unix socket and sent by a trainer over vLLM's weight transfer (``gloo``),
   next to loaded from disk (``bench/refit.py``).
7. Streamed completions through Dynamo's frontend at concurrency 1/16/64, one
   process against two, with time to first token (``bench/streaming.py``).
8. Parts 1 and 7's comparison measured by aiperf, Dynamo's own benchmark client
   (``bench/aiperf_compare.py``; skipped when aiperf is not installed).
9. ``fleet``: N sim workers (engine server + bridge each): the fleet refit's wall
   time against N, from disk and streamed, registration time and memory per
   worker (``bench/fleet.py``).

``--parts`` takes numbers or names (``--parts fleet``, ``--parts 6,fleet``).

Within a part, configurations are interleaved (each repetition runs every
configuration, in a rotating order: ``bench/measure.py``) and medians over
repetitions are reported, so that load from other work on the machine hits
them alike. Results: ``<out>/bench.md`` and ``<out>/bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench import (
    aiperf_compare,
    fleet,
    frontend_rollouts,
    hop,
    kv_events,
    large_rollout,
    refit,
    streaming,
    vllm_stack,
)
from bench.context import Bench, Options, say
from bench.report import HasGoals, PartResult
from harness import ROOT
from harness.procs import ProcessGroup

Part = Callable[[Bench], Awaitable[PartResult | None]]
PARTS: dict[int, Part] = {
    1: frontend_rollouts.run,
    2: hop.run,
    3: large_rollout.run,
    4: kv_events.run,
    5: vllm_stack.run,
    6: refit.run,
    7: streaming.run,
    8: aiperf_compare.run,
    9: fleet.run,
}
# ``--parts`` by name as well as by number.
PART_NAMES = {
    "frontend_rollouts": 1,
    "hop": 2,
    "large_rollout": 3,
    "kv_events": 4,
    "vllm_stack": 5,
    "refit": 6,
    "streaming": 7,
    "aiperf_compare": 8,
    "fleet": 9,
}
# Parts 1, 2, 7 and 8 measure the same simulated engine servers.
SIM_ENGINE_PARTS = {1, 2, 7, 8}


@dataclasses.dataclass
class Meta:
    when: str
    cpus: int | None
    python: str
    reps: int
    quick: bool
    seconds: float = 0.0


@contextlib.contextmanager
def scratch(keep: bool) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        yield root
    finally:
        if keep:
            say(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


async def run_parts(
    parts: list[int], options: Options, keep_logs: bool, table: dict[int, Part] | None = None
) -> tuple[Meta, dict[int, PartResult]]:
    """``table``: the parts by number (default ``PARTS``)."""
    table = table or PARTS
    meta = Meta(
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        reps=options.reps,
        quick=options.quick,
    )
    results: dict[int, PartResult] = {}
    with scratch(keep_logs) as root, ProcessGroup(root / "logs") as group:
        bench = Bench(options, root, group)
        started = time.monotonic()
        for i, part in enumerate(parts):
            result = await table[part](bench)
            if result is not None:
                results[part] = result
            say(f"  ({time.monotonic() - started:.0f}s so far)")
            if part in SIM_ENGINE_PARTS and not SIM_ENGINE_PARTS & set(parts[i + 1 :]):
                bench.stop_sim_engines()
        meta.seconds = time.monotonic() - started
    return meta, results


def goals_line(results: dict[int, PartResult]) -> str | None:
    """One line for the top of bench.md: how many of the parts' goals this run
    met, and the ones it missed (None: no part measured against goals)."""
    goals = {p: r.goals() for p, r in sorted(results.items()) if isinstance(r, HasGoals)}
    goals = {p: per for p, per in goals.items() if per}
    if not goals:
        return None
    every = [(p, g) for p, per in goals.items() for g in per]
    missed = "; ".join(f"part {p}, {g.what} ({g.measured})" for p, g in every if not g.met)
    parts = " and ".join(str(p) for p in goals)
    return (
        f"**Goals: {sum(g.met for _, g in every)} of {len(every)} met in this run** "
        f"(part{'s' if len(goals) > 1 else ''} {parts}; each part's goals table says which)"
        + (f"; not met: {missed}." if missed else ".")
    )


def report(meta: Meta, results: dict[int, PartResult]) -> str:
    head = [
        "# make bench",
        "",
        f"{meta.when}, {meta.cpus} CPUs, python {meta.python}; medians over {meta.reps} "
        "interleaved repetitions. Ratios matter more than absolute numbers "
        "(the machine is shared; the load generator runs on the same cores).",
        "",
    ]
    if line := goals_line(results):
        head += [line, ""]
    return "\n".join(head + [results[part].render() for part in sorted(results)])


def as_json(meta: Meta, results: dict[int, PartResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"meta": dataclasses.asdict(meta)}
    for part, result in sorted(results.items()):
        out[f"part{part}"] = dataclasses.asdict(result)
    return out


def parse_part(text: str) -> int:
    """A ``--parts`` entry: a part's number or name (ValueError naming them)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text in PART_NAMES:
        return PART_NAMES[text]
    names = ", ".join(f"{n} ({k})" for k, n in PART_NAMES.items())
    raise ValueError(f"--parts: no part {text!r} (there are {names})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts",
        default="4,1,7,2,3,5,6,8,9",
        help="which parts, in this order, by number or name (fleet, refit, ...; default: all)",
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions per cell (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--engine-server-args",
        default="",
        help="extra flags for the sim engine servers (e.g. '--event-loop asyncio')",
    )
    parser.add_argument(
        "--aiperf",
        default="",
        help="the aiperf command part 8 runs (default: .aiperf/bin/aiperf; none: skipped)",
    )
    parser.add_argument(
        "--fleet-sizes",
        default=",".join(map(str, fleet.DEFAULT_SIZES)),
        help="part 9: the fleet sizes, in this order (default %(default)s)",
    )
    parser.add_argument(
        "--fleet-mb",
        type=int,
        default=None,
        help=f"part 9: the synthetic checkpoint's MB (default {fleet.DEFAULT_MB}; "
        f"{fleet.QUICK_MB} with --quick)",
    )
    parser.add_argument(
        "--fleet-reps",
        type=int,
        default=None,
        help=f"part 9: refits per path and size (default {fleet.DEFAULT_REPS}; 1 with --quick)",
    )
    args = parser.parse_args(argv)
    try:
        parts = [parse_part(p) for p in args.parts.split(",")]
        sizes = tuple(int(n) for n in args.fleet_sizes.split(","))
    except ValueError as e:
        parser.error(str(e))
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: no part {unknown} (there are {sorted(PARTS)})")
    if not sizes or min(sizes) < 1:
        parser.error(f"--fleet-sizes: worker counts of 1 or more, got {args.fleet_sizes!r}")
    if (args.fleet_mb is not None and args.fleet_mb < 4) or (
        args.fleet_reps is not None and args.fleet_reps < 1
    ):
        parser.error("--fleet-mb: 4 or more (tensors of 4 MB); --fleet-reps: 1 or more")
    settings = fleet.FleetSettings(sizes, args.fleet_mb, args.fleet_reps)
    table: dict[int, Part] = {**PARTS, 9: functools.partial(fleet.run, settings=settings)}
    if args.aiperf and aiperf_compare.find_aiperf(args.aiperf) is None:
        parser.error(f"--aiperf: no command {args.aiperf!r}")
    options = Options(args.reps, args.quick, tuple(args.engine_server_args.split()), args.aiperf)
    try:
        import uvloop  # as Dynamo's workers and the engine server run

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        meta, results = runner.run(run_parts(parts, options, args.keep_logs, table))
    text = report(meta, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(as_json(meta, results), indent=1))
    (args.out / "bench.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwritten to {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
