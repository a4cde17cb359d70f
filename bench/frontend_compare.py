"""(a) one process against (b) bridge + engine server, through one Dynamo frontend:
the set-up parts 1 and 7 share, and the shape of their section of bench.md. (b)
runs three ways: the multiplexed stream over TCP and over a unix socket, and one
call per request over TCP (and, where a part asks, variants of the TCP bridge
with a lever turned off). Each bridge has an engine server of its own, as
deployed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ClassVar

import aiohttp

from bench.context import Bench, say
from bench.measure import Config, interleaved
from bench.report import (
    Difference,
    Figure,
    Goal,
    cpu_table,
    goals_and_failures,
    one_process_vs_split_table,
)
from bench.stats import Summary, summarize
from harness.procs import Proc

# Builds one configuration: (bench, session, model name, its serving processes).
MakeConfig = Callable[[Bench, aiohttp.ClientSession, str, Sequence[Proc]], Config]


@dataclass
class OneProcessVsBridges:
    """What a part measured, (a) against (b) per transport, and its section of
    bench.md: the part's notes, the (a)-vs-(b) table, the goals and the failed
    requests, then CPU per request by process. A part names its configurations,
    the table's figures and differences, and writes its notes and goals."""

    # configuration -> concurrency -> medians over repetitions
    summaries: dict[str, dict[int, Summary]]

    one_process: ClassVar[str]
    # (b): model name -> label.
    transports: ClassVar[Mapping[str, str]]
    concurrency: ClassVar[Sequence[int]]
    figures: ClassVar[Sequence[Figure]]
    differences: ClassVar[Sequence[Difference]]
    # The CPU table: (a)'s label there, the words above it, its columns after CPU's.
    one_process_label: ClassVar[str]
    cpu_note: ClassVar[str]
    cpu_figures: ClassVar[Sequence[Figure]] = ()

    def goals(self) -> list[Goal]:
        raise NotImplementedError

    def notes(self) -> list[str]:
        """The section's heading, and what to know before its tables."""
        raise NotImplementedError

    def render(self) -> str:
        s = self.summaries
        lines = self.notes()
        lines += one_process_vs_split_table(
            s, self.one_process, self.transports, self.concurrency, self.figures, self.differences
        )
        lines += goals_and_failures(self.goals(), s)
        labels = {self.one_process: self.one_process_label, **self.transports}
        lines += [self.cpu_note, "", *cpu_table(s, labels, self.concurrency, self.cpu_figures)]
        return "\n".join([*lines, ""])


@asynccontextmanager
async def frontend_session() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP session without a connection limit, for closed-loop load."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


async def one_process_vs_bridges(
    bench: Bench,
    one_process: str,
    transports: Sequence[str],
    unary_flag: str,
    make_config: MakeConfig,
    concurrency: Sequence[int],
    variants: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict[int, Summary]]:
    """Medians per configuration and concurrency. ``one_process`` and the three
    ``transports`` (stream over TCP, stream over unix, one call each over TCP) are
    the model names each is served as; ``unary_flag`` makes a bridge send one call
    per request. ``variants``: more bridges over TCP (model name -> their extra
    flags), to show one lever on and off in the same run."""
    tcp, unix, unary = transports
    frontend = bench.frontend()
    worker = bench.start_worker(one_process, bench.sim_args())
    shared = bench.sim_engines()
    # One engine server per bridge, as deployed (``Bench.own_sim_engine`` says why).
    engines = {tcp: shared["tcp"], unix: shared["unix"]}
    own = {name: bench.own_sim_engine(name) for name in (unary, *(variants or {}))}
    engines.update(own)
    bridges = {
        tcp: bench.start_bridge(tcp, engines[tcp].address),
        unix: bench.start_bridge(unix, engines[unix].address),
        unary: bench.start_bridge(unary, engines[unary].address, unary_flag, "unary"),
    }
    for name, flags in (variants or {}).items():
        bridges[name] = bench.start_bridge(name, engines[name].address, *flags)
    serving = {one_process: [frontend, worker]}
    for name, bridge in bridges.items():
        serving[name] = [frontend, bridge, engines[name].proc]
    names = (one_process, tcp, unix, unary, *(variants or {}))
    bench.wait_models(names)
    async with frontend_session() as session:
        configs = [make_config(bench, session, name, serving[name]) for name in names]
        for config in configs:  # warm-up: connections, caches
            await config.measure(16, 64)
        cells = await interleaved(configs, concurrency, bench.options.reps, bench.requests_for, say)
    bench.stop(worker, *bridges.values(), *(e.proc for e in own.values()))
    return {name: {c: summarize(cs) for c, cs in per.items()} for name, per in cells.items()}
