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
from bench.frontend_compare import OneProcessVsBridges, one_process_vs_bridges
from bench.measure import Config
from bench.report import (
    P50_MS,
    P99_MS,
    RPS,
    Goal,
    added_p50_at_c1,
)
from bench.stats import Cell, closed_loop
from harness.procs import Proc
from rl_client import driver

# (a), then (b)'s transports; each is also the model name it is served as.
ONE_PROCESS = "inproc"
TRANSPORTS = {
    "grpc-tcp": "stream, tcp",
    "grpc-unix": "stream, unix",
    "unary-tcp": "unary, tcp",
}

# The goals, shown next to what was measured: (b)/(a) throughput at c=64 by
# transport (and the c=1 latency goal, ``report.added_p50_at_c1``).
GOAL_RPS_RATIO_C64 = {"grpc-tcp": 0.95, "grpc-unix": 1.0}


@dataclass
class FrontendRollouts(OneProcessVsBridges):
    one_process = ONE_PROCESS
    transports = TRANSPORTS
    concurrency = CONCURRENCY
    figures = (RPS, P50_MS, P99_MS)
    differences = (
        ("p50 +ms", lambda a, b: f"**{b.p50_ms - a.p50_ms:+.2f}**"),
        ("p99 (b)/(a)", lambda a, b: f"{b.p99_ms / a.p99_ms:.2f}"),
    )
    one_process_label = ONE_PROCESS
    cpu_note = "CPU milliseconds per rollout, by process (where the cost goes):"

    def goals(self) -> list[Goal]:
        s, a = self.summaries, self.summaries[ONE_PROCESS]
        out = [
            Goal.at_least(f"rps (b)/(a) at c=64, {TRANSPORTS[t]}", s[t][64].rps / a[64].rps, goal)
            for t, goal in GOAL_RPS_RATIO_C64.items()
            if 64 in a
        ]
        out += added_p50_at_c1(a, {t: s[t] for t in GOAL_RPS_RATIO_C64}, TRANSPORTS)
        return out

    def notes(self) -> list[str]:
        return [
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
