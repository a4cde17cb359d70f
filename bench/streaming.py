"""Part 7: streamed completions through Dynamo's frontend at concurrency 1/16/64,
one process against two. (a) a Dynamo worker serving the simulated engine in
its own process (the same codec and engine code, no hop); (b) bridge + engine
server: completions multiplexed on the ``Generates`` stream over TCP and over a
unix socket, and one ``Generate`` call each over TCP; and the TCP stream with
pacing off (``--generate-pacing off``), to show that lever in the same run.
Zero-delay engine, the
same prompts and lengths as part 1, time to first token and CPU time per
request for every process."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from bench.context import GEN_TOKENS, PROMPT_TOKENS, Bench, say
from bench.frontend_compare import OneProcessVsBridges, one_process_vs_bridges
from bench.measure import Config
from bench.report import (
    P50_MS,
    RPS,
    TTFT_P50_MS,
    Goal,
    added_p50_at_c1,
    fmt,
)
from bench.stats import Cell, closed_loop
from harness.procs import Proc

CONCURRENCY = (1, 16, 64)
ONE_PROCESS = "sinproc"
# (b)'s transports; each is also the model name it is served as.
TRANSPORTS = {
    "sgrpc-tcp": "stream, tcp",
    "sgrpc-unix": "stream, unix",
    "sunary-tcp": "one call each, tcp",
    "sgrpc-unpaced": "stream, tcp, unpaced",
}
# Bridges (over TCP) beside the three every part runs: name -> extra flags.
VARIANTS = {"sgrpc-unpaced": ("--generate-pacing", "off")}
# The goals, shown next to what was measured.
GOAL_RPS_RATIO = 0.9
GOAL_TTFT_RATIO = 1.15
GOAL_BRIDGE_CPU_MS = 2.0
# Where the goals hold: the streams, at the loaded concurrencies.
GOAL_TRANSPORTS = ("sgrpc-tcp", "sgrpc-unix")
GOAL_CONCURRENCY = (16, 64)


@dataclass
class Streaming(OneProcessVsBridges):
    one_process = ONE_PROCESS
    transports = TRANSPORTS
    concurrency = CONCURRENCY
    figures = (RPS, TTFT_P50_MS, P50_MS)
    differences = (
        ("TTFT (b)/(a)", lambda a, b: f"**{b.ttft_p50_ms / a.ttft_p50_ms:.2f}**"),
        ("p50 +ms", lambda a, b: f"{b.p50_ms - a.p50_ms:+.2f}"),
    )
    one_process_label = "one process"
    cpu_note = (
        "CPU milliseconds per streamed request, by process, and the SSE events that "
        "carried each request's tokens (every process pays per event: the worker or "
        "bridge hands Dynamo a chunk, the frontend frames it, the load generator parses "
        "it; a process whose loop is saturated merges more tokens into each):"
    )
    cpu_figures = (("events / request", lambda x: fmt(x.events_per_request, 1)),)

    def goals(self) -> list[Goal]:
        s, a = self.summaries, self.summaries[ONE_PROCESS]
        loaded = [(c, t) for c in GOAL_CONCURRENCY if c in a for t in GOAL_TRANSPORTS]
        out = [
            Goal.at_least(
                f"rps (b)/(a) at c={c}, {TRANSPORTS[t]}", s[t][c].rps / a[c].rps, GOAL_RPS_RATIO
            )
            for c, t in loaded
        ]
        out += [
            Goal.at_most(
                f"TTFT p50 (b)/(a) at c={c}, {TRANSPORTS[t]}",
                s[t][c].ttft_p50_ms / a[c].ttft_p50_ms,
                GOAL_TTFT_RATIO,
            )
            for c, t in loaded
        ]
        out += [
            Goal.at_most(
                f"bridge CPU per request at c={c}, {TRANSPORTS[t]}",
                sum(v for k, v in s[t][c].cpu_ms.items() if k.startswith("bridge")),
                GOAL_BRIDGE_CPU_MS,
                " ms",
            )
            for c, t in loaded
        ]
        out += added_p50_at_c1(a, {t: s[t] for t in GOAL_TRANSPORTS}, TRANSPORTS)
        return out

    def notes(self) -> list[str]:
        return [
            "## 7. Streamed completions through Dynamo's frontend (sim engine, zero delay, "
            f"{PROMPT_TOKENS}-token prompts, {GEN_TOKENS} tokens out, streamed as they come)",
            "",
            "(a) = in-process Dynamo worker; (b) = bridge + engine server. Goals (issue 15): "
            f"rps (b)/(a) >= {GOAL_RPS_RATIO} at c=16 and c=64, TTFT p50 (b)/(a) <= "
            f"{GOAL_TTFT_RATIO}, bridge CPU per streamed request <= {GOAL_BRIDGE_CPU_MS} ms. "
            "The stream is paced (contract revision 6: a completion's next delta comes once "
            "the bridge has handed the last to Dynamo); 'unpaced' is the same TCP stream "
            "with --generate-pacing off, every delta sent as it comes.",
            "",
            "Dynamo 1.6.1's frontend does not set TCP_NODELAY on its HTTP connections, so "
            "a streamed answer can stall about 40 ms on a delayed ACK whatever the backend "
            "(ai-dynamo/dynamo PR #14643). On this bench it shows at c=16: most requests of "
            "(a) and (b) alike wait about 40 ms for their first token (c=1 and c=4 do not), "
            "so rps at c=16 is bound by that wait and (b)/(a) there mostly measures the "
            "milliseconds the hop adds to it.",
            "",
        ]


def stream_sender(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    events: list[int] | None = None,
) -> Callable[[int], Awaitable[float]]:
    """``send(i)``: greedy streamed completion ``i``, read to its end; returns the
    time to its first token, and appends to ``events`` how many events carried its
    tokens. Anything but GEN_TOKENS tokens is an error."""

    async def send(i: int) -> float:
        body = {
            "model": model,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": GEN_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        started = time.perf_counter()
        first: float | None = None
        completion = 0
        carried = 0
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{model}: HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                if not raw.startswith(b"data:") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[5:])
                if "error" in event:
                    raise RuntimeError(f"{model}: {event['error']}")
                if event.get("choices"):
                    carried += 1
                    if first is None:
                        first = time.perf_counter() - started
                usage = event.get("usage")
                if usage:
                    completion = usage["completion_tokens"]
        if completion != GEN_TOKENS or first is None:
            raise RuntimeError(f"{model}: {completion} tokens streamed")
        if events is not None:
            events.append(carried)
        return first

    return send


def stream_config(
    bench: Bench, session: aiohttp.ClientSession, model: str, serving: Sequence[Proc]
) -> Config:
    url = f"{bench.start_frontend()}/v1/completions"
    events: list[int] = []
    send = stream_sender(session, url, model, bench.prompts, events)

    async def measure(concurrency: int, n: int) -> Cell:
        events.clear()
        cell = await closed_loop(model, send, concurrency, n)
        if events:
            cell.events_per_request = sum(events) / len(events)
        return cell

    return Config(model, serving, measure)


async def run(bench: Bench) -> Streaming:
    say("part 7: streamed completions through Dynamo's frontend, one process vs two")
    summaries = await one_process_vs_bridges(
        bench,
        ONE_PROCESS,
        tuple(t for t in TRANSPORTS if t not in VARIANTS),
        "--generate-transport",
        stream_config,
        CONCURRENCY,
        VARIANTS,
    )
    return Streaming(summaries)
