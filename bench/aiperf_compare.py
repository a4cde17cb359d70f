"""Part 8: the same comparison measured by aiperf (Dynamo's own benchmark client,
a load generator this project did not write): (a) a one-process Dynamo worker
against (b) bridge + engine server over TCP, streamed completions and rollouts
at concurrency 16 and 64, through one frontend.

aiperf is not a dependency (its pins differ from vLLM's): the part runs the
``aiperf`` command given with ``--aiperf`` (default ``.aiperf/bin/aiperf``, where
the README's recipe installs it) and is skipped, saying how to install it, when
there is none. Every run is one ``aiperf profile`` process with the README's
flags; its per-request export (``profile_export.jsonl``) gives the latencies and
times to first token, its summary the duration. aiperf's own CPU is not counted
(it runs in processes of its own); on a 2-core machine it is the busiest
process, so the serving side is less saturated here than in parts 1 and 7.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.context import GEN_TOKENS, PROMPT_TOKENS, Bench, say
from bench.measure import Config, interleaved
from bench.report import fmt, paired, table
from bench.stats import Cell, Summary, summarize
from harness import ROOT
from harness.procs import Proc

CONCURRENCY = (16, 64)
KINDS = {"stream": "streamed completions", "rollout": "rollouts"}
ONE_PROCESS = "ainproc"
BRIDGED = "agrpc-tcp"
DEFAULT_AIPERF = ROOT / ".aiperf" / "bin" / "aiperf"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
INSTALL_HINT = "python3 -m venv .aiperf && .aiperf/bin/pip install -q aiperf==0.13.0"


@dataclass
class AiperfCompare:
    aiperf: str
    # kind -> configuration -> concurrency -> medians over repetitions
    summaries: dict[str, dict[str, dict[int, Summary]]]

    def render(self) -> str:
        lines = [
            "## 8. The same comparison measured by aiperf "
            f"(sim engine, zero delay, {PROMPT_TOKENS}-token prompts, {GEN_TOKENS} tokens out)",
            "",
            f"`{self.aiperf} profile` with the README's flags, one run per cell. (a) = "
            "in-process Dynamo worker; (b) = bridge + engine server over TCP. aiperf is "
            "the busiest process on a small machine (its CPU is not in this table), so "
            "the serving side is less saturated than in parts 1 and 7. CPU: milliseconds "
            "per request of the serving processes.",
            "",
        ]
        rows = []
        for kind, label in KINDS.items():
            per = self.summaries[kind]
            for c in CONCURRENCY:
                a, b = per[ONE_PROCESS][c], per[BRIDGED][c]
                streamed = kind == "stream"
                rows.append(
                    [
                        label,
                        c,
                        fmt(a.rps),
                        fmt(b.rps),
                        f"**{b.rps / a.rps:.2f}**",
                        paired(a, b),
                        fmt(a.ttft_p50_ms, 2) if streamed else "",
                        fmt(b.ttft_p50_ms, 2) if streamed else "",
                        f"**{b.ttft_p50_ms / a.ttft_p50_ms:.2f}**" if streamed else "",
                        f"{b.p50_ms - a.p50_ms:+.2f}",
                        f"{_serving_cpu(a, 'worker'):.2f}",
                        f"{_serving_cpu(b, 'bridge'):.2f} + {_serving_cpu(b, 'engine'):.2f}",
                        a.errors + b.errors,
                    ]
                )
        lines += table(
            [
                "path",
                "conc",
                "(a) rps",
                "(b) rps",
                "rps (b)/(a)",
                "paired",
                "(a) TTFT p50 ms",
                "(b) TTFT p50 ms",
                "TTFT (b)/(a)",
                "p50 +ms",
                "(a) worker CPU ms",
                "(b) bridge + engine CPU ms",
                "failed",
            ],
            "lrrrrlrrrrrrr",
            rows,
        )
        return "\n".join([*lines, ""])


def _serving_cpu(summary: Summary, role: str) -> float:
    """CPU milliseconds per request of the serving processes with ``role``."""
    return sum(v for k, v in summary.cpu_ms.items() if k.startswith(role))


def find_aiperf(given: str) -> str | None:
    """The aiperf command to run: ``given``, else the README's ``.aiperf`` one."""
    if given:
        return given if Path(given).exists() or shutil.which(given) else None
    return str(DEFAULT_AIPERF) if DEFAULT_AIPERF.exists() else None


def cell_from_export(config: str, concurrency: int, run_dir: Path) -> Cell:
    """A Cell from one aiperf run: per-request latencies and TTFTs, failures, duration."""
    summary = json.loads(next(run_dir.rglob("profile_export_aiperf.json")).read_text())
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    for line in next(run_dir.rglob("profile_export.jsonl")).read_text().splitlines():
        record = json.loads(line)
        if record.get("error"):
            errors += 1
            continue
        metrics = record["metrics"]
        latencies.append(metrics["request_latency"]["value"] / 1000)
        if "time_to_first_token" in metrics:
            ttfts.append(metrics["time_to_first_token"]["value"] / 1000)
    seconds = float(summary["benchmark_duration"]["avg"])
    return Cell(config, concurrency, len(latencies), seconds, latencies, errors, ttfts_s=ttfts)


def aiperf_args(bench: Bench, model: str, kind: str, dataset: Path) -> list[str]:
    """The README's flags for one kind of request."""
    args = [
        "profile",
        "--model",
        model,
        "--tokenizer",
        str(bench.model_dir),
        "--url",
        bench.start_frontend(),
        "--endpoint-type",
        "completions",
        "--use-server-token-count",
    ]
    if kind == "stream":
        return [
            *args,
            "--streaming",
            "--synthetic-input-tokens-mean",
            str(PROMPT_TOKENS),
            "--synthetic-input-tokens-stddev",
            "0",
            "--output-tokens-mean",
            str(GEN_TOKENS),
            "--output-tokens-stddev",
            "0",
            "--extra-inputs",
            "ignore_eos:true",
        ]
    return [*args, "--custom-dataset-type", "inputs_json", "--input-file", str(dataset)]


def aiperf_config(
    bench: Bench, aiperf: str, model: str, kind: str, serving: Sequence[Proc], scratch: Path
) -> Config:
    dataset = scratch / f"rollouts-{model}.json"
    runs = 0
    # aiperf takes a local tokenizer folder for a hub repo id when these are set at all.
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARIABLES}

    async def measure(concurrency: int, n: int) -> Cell:
        nonlocal runs
        runs += 1
        run_dir = scratch / f"{kind}-{model}-c{concurrency}-{runs}"
        argv = [
            *aiperf_args(bench, model, kind, dataset),
            "--concurrency",
            str(concurrency),
            "--request-count",
            str(n),
            "--artifact-dir",
            str(run_dir),
        ]
        proc = await asyncio.create_subprocess_exec(
            aiperf,
            *argv,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await proc.communicate()
        if proc.returncode:
            tail = output.decode(errors="replace")[-2000:]
            raise RuntimeError(f"aiperf exited with {proc.returncode}:\n{tail}")
        return cell_from_export(model, concurrency, run_dir)

    return Config(model, serving, measure)


async def write_dataset(bench: Bench, model: str, out: Path, count: int) -> None:
    """The README's rollout bodies (``python -m scripts.aiperf_inputs``) for ``model``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "scripts.aiperf_inputs",
        "--model",
        model,
        "--model-dir",
        str(bench.model_dir),
        "--out",
        str(out),
        "--count",
        str(count),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--max-tokens",
        str(GEN_TOKENS),
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
    )
    if await proc.wait():
        raise RuntimeError(f"scripts.aiperf_inputs failed for {model}")


async def run(bench: Bench) -> AiperfCompare | None:
    aiperf = find_aiperf(bench.options.aiperf)
    if aiperf is None:
        where = bench.options.aiperf or DEFAULT_AIPERF
        say(f"part 8 skipped: no aiperf at {where} (install it with: {INSTALL_HINT})")
        return None
    say(f"part 8: aiperf ({aiperf}), one process vs two")
    scratch = bench.root / "aiperf"
    scratch.mkdir(exist_ok=True)
    frontend = bench.frontend()
    worker = bench.start_worker(ONE_PROCESS, bench.sim_args())
    engine = bench.sim_engines()["tcp"]
    bridge = bench.start_bridge(BRIDGED, engine.address)
    serving = {ONE_PROCESS: [frontend, worker], BRIDGED: [frontend, bridge, engine.proc]}
    bench.wait_models(list(serving))
    count = max(bench.requests_for(c) for c in CONCURRENCY)
    for model in serving:
        await write_dataset(bench, model, scratch / f"rollouts-{model}.json", count)
    summaries: dict[str, dict[str, dict[int, Summary]]] = {}
    for kind in KINDS:
        configs = [
            aiperf_config(bench, aiperf, model, kind, procs, scratch)
            for model, procs in serving.items()
        ]
        say(f"  {KINDS[kind]}")
        cells = await interleaved(configs, CONCURRENCY, bench.options.reps, bench.requests_for, say)
        summaries[kind] = {
            name: {c: summarize(cs) for c, cs in per.items()} for name, per in cells.items()
        }
    bench.stop(worker, bridge)
    return AiperfCompare(aiperf, summaries)
