"""Part 2: the gRPC hop alone. The bridge's ``EngineClient`` straight to the engine
server (on the ``Rollouts`` stream over TCP and a unix socket, and one ``Rollout``
call each over TCP), next to the same engine code called in this process."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.context import CONCURRENCY, GEN_TOKENS, Bench, say
from bench.local_engine import LocalEngine
from bench.measure import Config, interleaved
from bench.report import fmt, table
from bench.stats import Cell, Summary, closed_loop, summarize
from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb
from harness.procs import Proc

IN_PROCESS = "in-process"
LABELS = {
    IN_PROCESS: IN_PROCESS,
    "grpc-tcp": "stream, tcp",
    "grpc-unix": "stream, unix",
    "unary-tcp": "unary, tcp",
}


@dataclass
class Hop:
    # path -> concurrency -> medians over repetitions
    summaries: dict[str, dict[int, Summary]]

    def render(self) -> str:
        lines = [
            "## 2. The gRPC hop alone (the bridge's EngineClient straight to the engine server)",
            "",
            "CPU ms per rollout: the load generator's process (which runs the engine itself "
            "in the in-process rows) and the engine server's.",
            "",
        ]
        rows = []
        for c in CONCURRENCY:
            base = self.summaries[IN_PROCESS][c].rps
            for name, label in LABELS.items():
                r = self.summaries[name][c]
                rows.append(
                    [
                        c,
                        label,
                        fmt(r.rps),
                        fmt(r.p50_ms, 3),
                        fmt(r.p99_ms, 3),
                        f"{r.rps / base:.2f}",
                        f"{r.cpu_ms.get('client', 0):.2f}",
                        f"{r.cpu_ms.get('engine', 0):.2f}",
                    ]
                )
        header = ["conc", "path", "rps", "p50 ms", "p99 ms", "rps vs in-process"]
        lines += table([*header, "client CPU ms", "server CPU ms"], "rlrrrrrr", rows)
        return "\n".join([*lines, ""])


async def run(bench: Bench) -> Hop:
    say("part 2: the gRPC hop alone (Rollout RPCs straight to the engine server)")
    engines = bench.sim_engines()
    local = LocalEngine(["--backend", "sim", *bench.sim_args()])
    await local.start()
    clients = {transport: EngineClient(e.address) for transport, e in engines.items()}
    for client in clients.values():
        await client.wait_ready(30)
    ids = itertools.count(1)

    def request(i: int) -> pb.RolloutRequest:
        return pb.RolloutRequest(
            request_id=f"b{next(ids)}",
            prompt_token_ids=bench.prompts[i % len(bench.prompts)],
            greedy=True,
            max_new_tokens=GEN_TOKENS,
        )

    async def send_local(i: int) -> None:
        await local.rollout(request(i))

    def grpc_sender(client: EngineClient, stream: bool) -> Callable[[int], Awaitable[None]]:
        async def send(i: int) -> None:
            if stream:
                await client.stream_rollout(request(i))
            else:
                await client.rollout(request(i))

        return send

    def config(name: str, send: Callable[[int], Awaitable[None]], serving: list[Proc]) -> Config:
        async def measure(concurrency: int, n: int) -> Cell:
            return await closed_loop(name, send, concurrency, n)

        return Config(name, serving, measure)

    configs = [
        config(IN_PROCESS, send_local, []),
        config("grpc-tcp", grpc_sender(clients["tcp"], True), [engines["tcp"].proc]),
        config("grpc-unix", grpc_sender(clients["unix"], True), [engines["unix"].proc]),
        config("unary-tcp", grpc_sender(clients["tcp"], False), [engines["tcp"].proc]),
    ]
    for c in configs:  # warm-up
        await c.measure(16, 64)
    cells = await interleaved(configs, CONCURRENCY, bench.options.reps, bench.requests_for, say)
    for client in clients.values():
        await client.close()
    await local.shutdown()
    return Hop({name: {c: summarize(cs) for c, cs in per.items()} for name, per in cells.items()})
