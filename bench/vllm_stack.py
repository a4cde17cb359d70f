"""Part 5: the vLLM engine server (CPU, tiny model) through the whole stack, next to
``AsyncLLM`` called directly (``bench.vllm_direct``, in its own process), with
the same prompts and concurrency."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.context import GEN_TOKENS, Bench, say
from bench.frontend_compare import frontend_session
from bench.frontend_rollouts import rollout_sender
from bench.measure import Config, interleaved
from bench.report import fmt, table
from bench.stats import Cell, Summary, closed_loop, summarize
from harness.engine import tiny_vllm_args
from harness.env import importable
from harness.procs import Proc, Role
from harness.waits import wait_until
from rl_client import driver

CONCURRENCY = 16
STACK, DIRECT = "stack", "direct"


@dataclass
class VllmStack:
    concurrency: int
    stack: Summary
    direct: Summary

    def render(self) -> str:
        st, d = self.stack, self.direct
        lines = [
            f"## 5. vLLM (CPU, tiny model), concurrency {self.concurrency}, "
            f"{GEN_TOKENS} tokens out",
            "",
            *table(
                ["path", "rps", "p50 ms", "p99 ms"],
                "lrrr",
                [
                    ["AsyncLLM called directly", fmt(d.rps, 2), fmt(d.p50_ms), fmt(d.p99_ms)],
                    [
                        "frontend + bridge + vLLM engine server",
                        fmt(st.rps, 2),
                        fmt(st.p50_ms),
                        fmt(st.p99_ms),
                    ],
                    ["**ratio**", f"**{st.rps / d.rps:.2f}**", "", ""],
                ],
            ),
            "",
            "CPU ms per rollout, by process:",
            "",
        ]
        rows = []
        for name, r in ((DIRECT, d), (STACK, st)):
            cpu = r.cpu_ms
            owner = cpu.get("engine", 0.0) + cpu.get("worker", 0.0)
            core = cpu.get("engine-children", 0.0) + cpu.get("worker-children", 0.0)
            rows.append(
                [
                    name,
                    f"{cpu.get('frontend', 0):.1f}",
                    f"{cpu.get('bridge', 0):.1f}",
                    f"{owner:.1f}",
                    f"{core:.1f}",
                    f"{cpu.get('client', 0):.1f}",
                    f"{sum(cpu.values()):.1f}",
                ]
            )
        lines += table(
            [
                "path",
                "frontend",
                "bridge",
                "engine server / direct driver",
                "vLLM EngineCore",
                "load generator",
                "total",
            ],
            "lrrrrrr",
            rows,
        )
        return "\n".join([*lines, ""])


class DirectEngine:
    """``bench.vllm_direct`` driven through its control folder (see there)."""

    def __init__(self, proc: Proc, ctl: Path, prompts_file: Path) -> None:
        self.proc = proc
        self.ctl = ctl
        self.prompts_file = prompts_file

    def ready(self) -> bool:
        return (self.ctl / "ready").exists()

    def run(self, concurrency: int, n: int, rep: int) -> Cell:
        out = self.ctl / f"result-{rep}.json"
        request = [str(self.prompts_file), concurrency, n, rep]
        (self.ctl / "request.tmp").write_text(json.dumps(request))
        os.replace(self.ctl / "request.tmp", self.ctl / "request")
        wait_until(out.exists, 600, "direct AsyncLLM run", [self.proc], interval=0.05)
        r = json.loads(out.read_text())
        return Cell(DIRECT, concurrency, r["n"], r["seconds"], r["latencies_s"])

    def quit(self) -> None:
        (self.ctl / "quit").write_text("")


async def run(bench: Bench) -> VllmStack | None:
    if not importable("vllm"):
        say("part 5: skipped (vLLM not installed)")
        return None
    say("part 5: the vLLM engine server through the whole stack vs AsyncLLM directly")
    vllm_args = [
        "--model",
        str(bench.model_dir),
        *tiny_vllm_args(),
        "--max-new-tokens",
        str(GEN_TOKENS),
    ]
    frontend = bench.frontend()
    ctl = bench.root / "direct"
    n = 48 if bench.options.quick else 384
    prompts_file = bench.root / "prompts.json"
    prompts_file.write_text(json.dumps(bench.prompts[:n]))
    # Both engines load at once (the direct one in the background).
    argv = [sys.executable, "-m", "bench.vllm_direct", str(ctl), *vllm_args]
    direct = DirectEngine(
        bench.group.spawn("vllm-direct", argv, role=Role.WORKER), ctl, prompts_file
    )
    engine, address = bench.group.engine_server(
        "engine-vllm", *vllm_args, backend="vllm", timeout=600
    )
    bridge = bench.start_bridge("vllm", address)
    bench.wait_models(["vllm"], timeout=600)
    wait_until(direct.ready, 600, "direct AsyncLLM", [direct.proc])
    rep_of_direct = iter(range(10**6))

    async with frontend_session() as session:
        client = driver.RolloutClient(bench.start_frontend(), "vllm", session=session)
        send = rollout_sender(client, bench.prompts, GEN_TOKENS, exact=False)

        async def measure_stack(concurrency: int, n: int) -> Cell:
            return await closed_loop(STACK, send, concurrency, n)

        async def measure_direct(concurrency: int, n: int) -> Cell:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, direct.run, concurrency, n, next(rep_of_direct))

        # Warm both.
        await measure_stack(CONCURRENCY, 16)
        await asyncio.get_running_loop().run_in_executor(None, direct.run, CONCURRENCY, n, -1)
        configs = [
            Config(STACK, [frontend, bridge, engine], measure_stack),
            Config(DIRECT, [direct.proc], measure_direct),
        ]
        cells = await interleaved(configs, [CONCURRENCY], bench.options.reps, lambda c: n, say)
    direct.quit()
    bench.stop(bridge, engine, direct.proc)
    return VllmStack(
        CONCURRENCY, summarize(cells[STACK][CONCURRENCY]), summarize(cells[DIRECT][CONCURRENCY])
    )
