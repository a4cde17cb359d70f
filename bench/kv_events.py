"""Part 4: KV events, engine server -> the bridge's relay -> Dynamo's
``KvEventPublisher``: the rate the relay sustains with nothing lost, and the
latency from the engine's publish to the call into the publisher.

The engine server is ``bench.kv_source`` (events at a set rate, each stored
block's hash its emission time), the bridge ``bench.kv_worker`` (the publisher
timed). One stored block per event, about one engine batch per millisecond."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.context import Bench, say
from bench.report import fmt, table
from bench.stats import percentile
from harness import ROOT
from harness.procs import Role
from harness.waits import wait_until

RATES = (5_000, 10_000, 20_000, 40_000, 80_000)
# What "sustained" means: nothing lost or duplicated, and p99 at most this.
SUSTAINED_P99_MS = 100.0


@dataclass
class Rate:
    """One offered rate, held for a burst of seconds."""

    offered_per_s: int
    emitted: int
    emitted_per_s: float
    delivered: int
    lost: int
    duplicates: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def met(self) -> bool:
        return not self.lost and not self.duplicates and self.p99_ms <= SUSTAINED_P99_MS


@dataclass
class KvEvents:
    rates: list[Rate]

    @property
    def sustained_per_s(self) -> int:
        """The highest offered rate met, with every lower rate met too (0: none)."""
        best = 0
        for r in self.rates:
            if not r.met:
                break
            best = r.offered_per_s
        return best

    def render(self) -> str:
        rows = [
            [
                f"{r.offered_per_s:,}",
                fmt(r.emitted_per_s, 0),
                f"{r.delivered:,}",
                r.lost,
                r.duplicates,
                fmt(r.p50_ms, 2),
                fmt(r.p99_ms, 2),
                fmt(r.max_ms, 2),
            ]
            for r in self.rates
        ]
        lines = [
            "## 4. KV events: engine server -> relay -> Dynamo's KvEventPublisher",
            "",
            "One stored block per event, about one engine batch per millisecond; latency "
            "from the engine's publish to the call into Dynamo's publisher.",
            "",
            f"Sustained with nothing lost and p99 <= {SUSTAINED_P99_MS:.0f} ms: "
            f"**{self.sustained_per_s:,} events/s** "
            "(the highest offered rate that met both).",
            "",
            *table(
                [
                    "offered ev/s",
                    "emitted ev/s",
                    "delivered",
                    "lost",
                    "dup",
                    "p50 ms",
                    "p99 ms",
                    "max ms",
                ],
                "rrrrrrrr",
                rows,
            ),
        ]
        return "\n".join([*lines, ""])


async def run(bench: Bench) -> KvEvents:
    say("part 4: KV events through the relay into Dynamo's publisher")
    stats_dir = bench.root / "kvstats"
    stats_dir.mkdir()
    log = open(bench.root / "kv-source.log", "wb")
    # Not in the process group: it is driven over its stdin and stdout.
    source = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_source"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    assert source.stdin is not None and source.stdout is not None
    commands, answers = source.stdin, source.stdout
    try:
        address = json.loads(answers.readline())["address"]
        bench.start_frontend()
        argv = [
            sys.executable,
            "-m",
            "bench.kv_worker",
            str(stats_dir),
            "--engine",
            address,
            "--model-path",
            str(bench.model_dir),
            "--served-model-name",
            "kv",
            "--namespace",
            "ns-kv",
            "--log-level",
            "warning",
        ]
        worker = bench.group.spawn("kv-worker", argv, bench.stack.env, Role.BRIDGE)
        bench.wait_models(["kv"])

        def stats(start: int) -> dict[str, Any]:
            out = stats_dir / "stats.json"
            out.unlink(missing_ok=True)
            (stats_dir / "request").write_text(str(start))
            wait_until(out.exists, 20, "kv worker stats", [worker], interval=0.02)
            answer: dict[str, Any] = json.loads(out.read_text())
            return answer

        # Let the relay's subscription and the publisher settle.
        await asyncio.sleep(1.0)
        rates: list[Rate] = []
        seen = stats(0)["blocks"]
        seconds = 1.0 if bench.options.quick else 2.0
        for rate in RATES:
            batch = max(1, rate // 1000)  # about one engine batch per millisecond
            commands.write(f"burst {rate} {seconds} {batch}\n")
            commands.flush()
            line = await asyncio.get_running_loop().run_in_executor(None, answers.readline)
            emitted = json.loads(line)
            deadline = time.monotonic() + 15
            while True:
                s = stats(seen)
                if s["blocks"] - seen >= emitted["emitted"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            got = s["blocks"] - seen
            lat = s["latency_ns"]
            seen = s["blocks"]
            r = Rate(
                offered_per_s=rate,
                emitted=emitted["emitted"],
                emitted_per_s=emitted["emitted"] / emitted["seconds"],
                delivered=got,
                lost=emitted["emitted"] - got,
                duplicates=s["duplicates"],
                p50_ms=percentile(lat, 50) / 1e6,
                p99_ms=percentile(lat, 99) / 1e6,
                max_ms=max(lat) / 1e6 if lat else float("nan"),
            )
            rates.append(r)
            say(
                f"  {rate}/s offered: {r.emitted_per_s:.0f}/s emitted, "
                f"lost {r.lost}, p50 {r.p50_ms:.2f} ms p99 {r.p99_ms:.2f} ms"
            )
        bench.stop(worker)
        return KvEvents(rates)
    finally:
        with contextlib.suppress(Exception):
            commands.write("quit\n")
            commands.flush()
        try:
            source.wait(10)
        except subprocess.TimeoutExpired:
            source.kill()
        log.close()
