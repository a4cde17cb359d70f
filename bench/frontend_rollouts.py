"""Part 1: rollouts through Dynamo's frontend at concurrency 1/16/64/256, one
process against two. (a) a Dynamo worker serving the simulated engine in its own
process; (b) bridge + engine server over gRPC: rollouts on the ``Rollouts``
stream over TCP and over a unix socket, and one ``Rollout`` call each over TCP.
Zero-delay engine, CPU time per rollout for every process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from bench.context import CONCURRENCY, GEN_TOKENS, PROMPT_TOKENS, Bench, say
from bench.frontend_compare import one_process_vs_bridges
from bench.measure import Config
from bench.report import Goal, added_p50_at_c1, fmt, goal_table, paired, table
from bench.stats import Cell, Summary, closed_loop
from harness.procs import Proc
from rl_client import driver

# (a), then (b)'s transports; each is also the model name it is served as.
ONE_PROCESS = "inproc"
TRANSPORTS = {
    "grpc-tcp": "stream, tcp",
    "grpc-unix": "stream, unix",
    "unary-tcp": "unary, tcp",
}
CONFIGS = (ONE_PROCESS, *TRANSPORTS)

# The goals, shown next to what was measured: (b)/(a) throughput at c=64 by
# transport (and the c=1 latency goal, ``report.added_p50_at_c1``).
GOAL_RPS_RATIO_C64 = {"grpc-tcp": 0.95, "grpc-unix": 1.0}


@dataclass
class FrontendRollouts:
    # configuration -> concurrency -> medians over repetitions
    summaries: dict[str, dict[int, Summary]]

    def goals(self) -> list[Goal]:
        s, a = self.summaries, self.summaries[ONE_PROCESS]
        out = [
            Goal.at_least(f"rps (b)/(a) at c=64, {TRANSPORTS[t]}", s[t][64].rps / a[64].rps, goal)
            for t, goal in GOAL_RPS_RATIO_C64.items()
            if 64 in a
        ]
        out += added_p50_at_c1(a, {t: s[t] for t in GOAL_RPS_RATIO_C64}, TRANSPORTS)
        return out

    def render(self) -> str:
        s = self.summaries
        lines = [
            "## 1. Rollouts through Dynamo's frontend (sim engine, zero delay, "
            f"{PROMPT_TOKENS}-token prompts, {GEN_TOKENS} tokens out)",
            "",
            "(a) = in-process Dynamo worker; (b) = bridge + engine server over gRPC.",
            "",
            "rps (b)/(a) is the ratio of medians; paired is the median, and the range, "
            "of the ratios within each repetition (the configurations of a repetition "
            "run back to back, so slow drifts in the machine's other load cancel).",
            "",
        ]
        rows = []
        for c in CONCURRENCY:
            a = s[ONE_PROCESS][c]
            for transport, label in TRANSPORTS.items():
                b = s[transport][c]
                rows.append(
                    [
                        c,
                        fmt(a.rps),
                        fmt(a.p50_ms, 2),
                        fmt(a.p99_ms, 2),
                        label,
                        fmt(b.rps),
                        fmt(b.p50_ms, 2),
                        fmt(b.p99_ms, 2),
                        f"**{b.rps / a.rps:.2f}**",
                        paired(a, b),
                        f"**{b.p50_ms - a.p50_ms:+.2f}**",
                        f"{b.p99_ms / a.p99_ms:.2f}",
                    ]
                )
        lines += table(
            [
                "conc",
                "(a) rps",
                "(a) p50 ms",
                "(a) p99 ms",
                "(b) transport",
                "(b) rps",
                "(b) p50 ms",
                "(b) p99 ms",
                "rps (b)/(a)",
                "paired",
                "p50 +ms",
                "p99 (b)/(a)",
            ],
            "rrrrlrrrrlrr",
            rows,
        )
        errors = sum(r.errors for per in s.values() for r in per.values())
        lines += ["", "Goals (issue 15):", "", *goal_table(self.goals())]
        lines += [
            "",
            f"Failed requests (not counted above): {errors}.",
            "",
            "CPU milliseconds per rollout, by process (where the cost goes):",
            "",
        ]
        rows = []
        for c in CONCURRENCY:
            for name in CONFIGS:
                cpu = s[name][c].cpu_ms
                if not cpu:
                    continue
                worker = sum(v for k, v in cpu.items() if k.startswith(("worker", "bridge")))
                rows.append(
                    [
                        c,
                        TRANSPORTS.get(name, name),
                        f"{cpu.get('frontend', 0):.2f}",
                        f"{worker:.2f}",
                        f"{cpu.get('engine', 0) + cpu.get('engine-children', 0):.2f}",
                        f"{cpu.get('client', 0):.2f}",
                        f"{sum(cpu.values()):.2f}",
                    ]
                )
        lines += table(
            [
                "conc",
                "config",
                "frontend",
                "worker / bridge",
                "engine server",
                "load generator",
                "total",
            ],
            "rlrrrrr",
            rows,
        )
        return "\n".join([*lines, ""])


def rollout_sender(
    client: driver.RolloutClient, prompts: Sequence[list[int]], max_tokens: int, exact: bool
) -> Callable[[int], Awaitable[None]]:
    """``send(i)``: greedy rollout ``i`` of ``prompts`` through the frontend."""

    async def send(i: int) -> None:
        result = await client.rollout(prompts[i % len(prompts)], greedy=True, max_tokens=max_tokens)
        # A greedy rollout may end on EOS before max_tokens (the same prompts in
        # every configuration); anything else is an error.
        n = len(result.token_ids)
        if exact and not (n == max_tokens or (result.finish_reason == "stop" and n < max_tokens)):
            raise RuntimeError(f"{client.model}: {n} tokens, {result.finish_reason}")

    return send


def frontend_config(
    bench: Bench, session: aiohttp.ClientSession, model: str, serving: Sequence[Proc]
) -> Config:
    """Rollouts of ``model`` through the frontend; ``serving``: its processes."""
    client = driver.RolloutClient(bench.start_frontend(), model, session=session)
    send = rollout_sender(client, bench.prompts, GEN_TOKENS, exact=True)

    async def measure(concurrency: int, n: int) -> Cell:
        return await closed_loop(model, send, concurrency, n)

    return Config(model, serving, measure)


async def run(bench: Bench) -> FrontendRollouts:
    say("part 1: rollouts through Dynamo's frontend, one process vs two")
    summaries = await one_process_vs_bridges(
        bench, ONE_PROCESS, tuple(TRANSPORTS), "--rollout-transport", frontend_config, CONCURRENCY
    )
    return FrontendRollouts(summaries)
