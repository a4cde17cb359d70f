"""``make bench``: the gRPC hop's cost, measured side by side in one run.

    python -m bench [--parts 4,1,2,3,5] [--reps 5] [--quick] [--out bench-results]

1. Rollouts through Dynamo's frontend at concurrency 1/16/64/256: (a) a Dynamo
   worker serving the simulated engine in its own process, (b) bridge + engine
   server over gRPC on TCP and on a unix socket. Zero-delay engine.
2. The gRPC hop alone: Rollout RPCs straight to the engine server, next to the
   same engine code called in this process.
3. A 16k-token rollout with routed experts (48 layers, top-8, uint8).
4. KV events: what the relay sustains into Dynamo's publisher, and the latency.
5. The vLLM engine server (CPU, tiny model) through the whole stack next to
   ``AsyncLLM`` called directly.

Configurations are interleaved (each repetition runs every configuration, in
a rotating order) and medians over repetitions are reported, so that load from
other work on the machine hits them alike. Results: ``<out>/bench.md`` and
``<out>/bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import psutil

from bench.local_engine import LocalEngine
from bench.stats import Cell, closed_loop, median, percentile, summarize
from bridge import driver
from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb
from harness import ROOT
from harness.env import dynamo_env
from harness.http import wait_for_model
from harness.procs import Proc, ProcessGroup
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until

PROMPT_TOKENS = 64
GEN_TOKENS = 32
CONCURRENCY = (1, 16, 64, 256)
LARGE_TOKENS = 16384
LARGE_EXPERTS = "48,8,128"
# (b)'s configurations: rollouts multiplexed on a Rollouts stream (the bridge's
# default) over TCP and a unix socket, and one Rollout call each over TCP.
TWO_PROCESS = ("grpc-", "hop-grpc-", "unary-", "hop-unary-")
PART1_MODELS = ("inproc", "grpc-tcp", "grpc-unix", "unary-tcp")
PART2_PATHS = ("in-process", "grpc-tcp", "grpc-unix", "unary-tcp")
TRANSPORT_NAMES = {
    "grpc-tcp": "stream, tcp",
    "grpc-unix": "stream, unix",
    "unary-tcp": "unary, tcp",
}


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def rotate(items: Sequence[Any], k: int) -> list[Any]:
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def sim_args(model_dir: Path) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--zero-delay",
        "--eos-rate",
        "0",
        "--max-new-tokens",
        str(GEN_TOKENS),
    ]


def requests_for(concurrency: int, quick: bool) -> int:
    n = {1: 300, 16: 800, 64: 1280, 256: 2048}[concurrency]
    return max(concurrency, n // 8) if quick else n


@contextlib.contextmanager
def stack_dir(keep: bool) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        yield root
    finally:
        if keep:
            say(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, group: ProcessGroup) -> None:
        self.args = args
        self.root = root
        self.group = group
        self.env = dynamo_env(root / "kv")
        self.model_dir = tiny_model_dir()
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.prompts = prompts(4096, self.vocab)
        self.frontend: Proc | None = None
        self.base_url = ""
        self.engines: dict[str, str] = {}
        self.results: dict[str, Any] = {}

    # -- processes -----------------------------------------------------------

    def start_frontend(self) -> None:
        if self.frontend is None:
            self.frontend, self.base_url = self.group.frontend("frontend", self.env)

    def start_bridge(self, name: str, engine_address: str, *extra: str) -> Proc:
        return self.group.bridge(
            f"bridge-{name}",
            engine_address,
            self.model_dir,
            name,
            f"ns-{name}",
            self.env,
            "--log-level",
            "warning",
            *extra,
        )

    def start_inprocess(self, name: str, engine_args: Sequence[str]) -> Proc:
        return self.group.spawn(
            f"worker-{name}",
            [
                sys.executable,
                "-m",
                "bench.inprocess_engine",
                "--model-path",
                str(self.model_dir),
                "--served-model-name",
                name,
                "--namespace",
                f"ns-{name}",
                "--log-level",
                "warning",
                "--",
                "--backend",
                "sim",
                *engine_args,
            ],
            self.env,
        )

    def start_engines(self, args: Sequence[str]) -> None:
        """The sim engine servers of parts 1 and 2, on TCP and on a unix socket."""
        extra = self.args.engine_server_args.split()
        _, tcp = self.group.engine_server("engine-tcp", *args, *extra)
        sock = self.root / "engine.sock"
        _, unix = self.group.engine_server("engine-unix", *args, *extra, listen=f"unix:{sock}")
        self.engines = {"tcp": tcp, "unix": unix}

    def stop(self, *names: str) -> None:
        """Stop the named processes (so idle ones do not weigh on later parts)."""
        for proc in [p for p in self.group.procs if p.name in names]:
            proc.stop()
            self.group.procs.remove(proc)
        self.engines = {k: v for k, v in self.engines.items() if f"engine-{k}" not in names}

    def wait_models(self, names: Sequence[str], timeout: float = 120.0) -> None:
        assert self.frontend is not None
        for name in names:
            wait_for_model(self.base_url, name, self.group.procs, timeout)

    def cpu_times(self, model: str) -> dict[str, float]:
        """CPU seconds so far of the processes serving ``model`` (and of this one)."""
        roles: dict[str, str | None] = {"client": None}
        if self.frontend is not None and not model.startswith(("hop-", "vllm-direct")):
            roles["frontend"] = "frontend"
        for proc in self.group.procs:
            if proc.name == f"worker-{model}":
                roles["worker"] = proc.name
            elif proc.name == f"bridge-{model}":
                roles["bridge"] = proc.name
            elif model.startswith(TWO_PROCESS) and proc.name == (
                f"engine-{model.rpartition('-')[2]}"
            ):
                roles["engine"] = proc.name
            elif model == "vllm" and proc.name == "engine-vllm":
                roles["engine"] = proc.name
            elif model == "vllm-direct" and proc.name == "vllm-direct":
                roles["worker"] = proc.name
        out = {}
        for role, name in roles.items():
            try:
                p = psutil.Process(self.group.get(name).pid) if name else psutil.Process()
                t = p.cpu_times()
                out[role] = t.user + t.system
                # Children apart: vLLM's EngineCore is a child process.
                children = 0.0
                for q in p.children(recursive=True) if name else []:
                    with contextlib.suppress(psutil.Error):
                        t = q.cpu_times()
                        children += t.user + t.system
                if children:
                    out[f"{role}-children"] = children
            except (psutil.Error, StopIteration):
                out[role] = 0.0
        return out

    # -- part 1 --------------------------------------------------------------

    async def http_cells(
        self,
        models: Sequence[str],
        concurrencies: Sequence[int],
        reps: int,
        n_for: Callable[[int], int],
        max_tokens: int,
        exact: bool = True,
    ) -> dict[str, dict[int, list[Cell]]]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        cells: dict[str, dict[int, list[Cell]]] = {
            m: {c: [] for c in concurrencies} for m in models
        }
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            clients = {m: driver.RolloutClient(self.base_url, m, session=session) for m in models}

            def sender(model: str) -> Callable[[int], Any]:
                client = clients[model]

                async def send(i: int) -> None:
                    result = await client.rollout(
                        self.prompts[i % len(self.prompts)], greedy=True, max_tokens=max_tokens
                    )
                    # A greedy rollout may end on EOS before max_tokens (the same prompts
                    # in every configuration); anything else is an error.
                    if exact and not (
                        len(result.token_ids) == max_tokens
                        or (result.finish_reason == "stop" and len(result.token_ids) < max_tokens)
                    ):
                        raise RuntimeError(
                            f"{model}: {len(result.token_ids)} tokens, {result.finish_reason}"
                        )

                return send

            for model in models:  # warm-up: connections, caches
                await closed_loop(model, sender(model), 16, 64)
            for c in concurrencies:
                for rep in range(reps):
                    for model in rotate(models, rep):
                        before = self.cpu_times(model)
                        cell = await closed_loop(model, sender(model), c, n_for(c))
                        after = self.cpu_times(model)
                        cell.cpu_ms = {
                            k: (after[k] - before[k]) * 1000 / max(cell.n, 1) for k in after
                        }
                        cells[model][c].append(cell)
                    say(
                        f"  c={c} rep {rep + 1}/{reps}: "
                        + ", ".join(
                            f"{m} {cells[m][c][-1].rps:.0f}/s p50 {cells[m][c][-1].p50_ms:.2f}ms"
                            for m in models
                        )
                    )
        return cells

    async def part1(self) -> None:
        say("part 1: rollouts through Dynamo's frontend, one process vs two")
        args = sim_args(self.model_dir)
        self.start_frontend()
        self.start_inprocess("inproc", args)
        self.start_engines(args)
        self.start_bridge("grpc-tcp", self.engines["tcp"])
        self.start_bridge("grpc-unix", self.engines["unix"])
        self.start_bridge("unary-tcp", self.engines["tcp"], "--rollout-transport", "unary")
        models = list(PART1_MODELS)
        self.wait_models(models)
        cells = await self.http_cells(
            models,
            CONCURRENCY,
            self.args.reps,
            lambda c: requests_for(c, self.args.quick),
            GEN_TOKENS,
        )
        self.results["part1"] = {
            m: {str(c): summarize(cs) for c, cs in per.items()} for m, per in cells.items()
        }

    # -- part 2 --------------------------------------------------------------

    async def part2(self) -> None:
        say("part 2: the gRPC hop alone (Rollout RPCs straight to the engine server)")
        args = sim_args(self.model_dir)
        if not self.engines:
            self.start_engines(args)
        local = LocalEngine(["--backend", "sim", *args])
        await local.start()
        clients = {name: EngineClient(addr) for name, addr in self.engines.items()}
        for client in clients.values():
            await client.wait_ready(30)
        counter = 0

        def request(i: int) -> pb.RolloutRequest:
            nonlocal counter
            counter += 1
            return pb.RolloutRequest(
                request_id=f"b{counter}",
                prompt_token_ids=self.prompts[i % len(self.prompts)],
                greedy=True,
                max_new_tokens=GEN_TOKENS,
            )

        async def send_local(i: int) -> None:
            await local.rollout(request(i))

        def grpc_sender(client: EngineClient, stream: bool) -> Callable[[int], Any]:
            async def send(i: int) -> None:
                if stream:
                    await client.stream_rollout(request(i))
                else:
                    await client.rollout(request(i))

            return send

        senders = {
            "hop-in-process": send_local,
            "hop-grpc-tcp": grpc_sender(clients["tcp"], stream=True),
            "hop-grpc-unix": grpc_sender(clients["unix"], stream=True),
            "hop-unary-tcp": grpc_sender(clients["tcp"], stream=False),
        }
        names = list(senders)
        cells: dict[str, dict[int, list[Cell]]] = {n: {c: [] for c in CONCURRENCY} for n in names}
        for name in names:
            await closed_loop(name, senders[name], 16, 64)
        for c in CONCURRENCY:
            for rep in range(self.args.reps):
                for name in rotate(names, rep):
                    n = requests_for(c, self.args.quick)
                    before = self.cpu_times(name)
                    cell = await closed_loop(name, senders[name], c, n)
                    after = self.cpu_times(name)
                    cell.cpu_ms = {k: (after[k] - before[k]) * 1000 / max(cell.n, 1) for k in after}
                    cells[name][c].append(cell)
            say(
                f"  c={c}: "
                + ", ".join(f"{n} {summarize(cells[n][c])['rps']:.0f}/s" for n in names)
            )
        for client in clients.values():
            await client.close()
        await local.shutdown()
        self.results["part2"] = {
            n.removeprefix("hop-"): {str(c): summarize(cs) for c, cs in per.items()}
            for n, per in cells.items()
        }

    # -- part 3 --------------------------------------------------------------

    async def part3(self) -> None:
        say(f"part 3: one {LARGE_TOKENS}-token rollout with routed experts {LARGE_EXPERTS}")
        args = [
            "--model",
            str(self.model_dir),
            "--zero-delay",
            "--eos-rate",
            "0",
            "--routed-experts",
            LARGE_EXPERTS,
            # A huge made-up vocabulary, so that no greedy position ever picks EOS.
            "--vocab-size",
            str(10**9),
            "--context-length",
            str(LARGE_TOKENS + PROMPT_TOKENS),
            "--max-new-tokens",
            str(LARGE_TOKENS),
        ]
        _, address = self.group.engine_server("engine-large", *args)
        self.start_frontend()
        self.start_bridge("large-grpc", address)
        self.start_inprocess("large-inproc", args)
        local = LocalEngine(["--backend", "sim", *args])
        await local.start()
        client = EngineClient(address)
        await client.wait_ready(30)
        self.wait_models(["large-grpc", "large-inproc"])
        prompt = self.prompts[0]
        reps = max(3, self.args.reps)
        # Warm every path up (first-call costs) with a short rollout.
        await local.rollout(
            pb.RolloutRequest(request_id="warm-local", prompt_token_ids=prompt, max_new_tokens=64)
        )
        await client.rollout(
            pb.RolloutRequest(request_id="warm-grpc", prompt_token_ids=prompt, max_new_tokens=64)
        )
        async with driver.RolloutClient(self.base_url, "large-inproc") as warm:
            await warm.rollout(prompt, max_tokens=64)
        async with driver.RolloutClient(self.base_url, "large-grpc") as warm:
            await warm.rollout(prompt, max_tokens=64)
        times: dict[str, list[float]] = {
            "in-process": [],
            "grpc": [],
            "http-inproc": [],
            "http-grpc": [],
        }
        sizes: dict[str, int] = {}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for rep in range(reps):
                for name in rotate(list(times), rep):
                    rid = f"large-{name}-{rep}"
                    started = time.perf_counter()
                    if name == "in-process":
                        resp = await local.rollout(
                            pb.RolloutRequest(request_id=rid, prompt_token_ids=prompt, greedy=True)
                        )
                        times[name].append(time.perf_counter() - started)
                        experts = resp.routed_experts
                        sizes["routed_experts_raw"] = len(experts.data)
                        sizes["raw_payload"] = (
                            len(experts.data) + 4 * len(resp.token_ids) + 8 * len(resp.logprobs)
                        )
                        sizes["tokens"] = len(resp.token_ids)
                        sizes["shape"] = list(experts.shape)  # type: ignore[assignment]
                    elif name == "grpc":
                        resp = await client.rollout(
                            pb.RolloutRequest(request_id=rid, prompt_token_ids=prompt, greedy=True)
                        )
                        times[name].append(time.perf_counter() - started)
                        sizes["grpc_message"] = resp.ByteSize()
                    else:
                        model = "large-inproc" if name == "http-inproc" else "large-grpc"
                        body = driver.build_rollout_body(
                            model, prompt, greedy=True, max_tokens=LARGE_TOKENS
                        )
                        async with session.post(
                            f"{self.base_url}/v1/completions", json=body
                        ) as http:
                            raw = await http.read()
                            if http.status != 200:
                                raise RuntimeError(f"HTTP {http.status}: {raw[:300]!r}")
                        result = driver.parse_rollout_response(json.loads(raw))
                        times[name].append(time.perf_counter() - started)
                        if len(result.token_ids) != LARGE_TOKENS:
                            raise RuntimeError(
                                f"{model}: {len(result.token_ids)} tokens, "
                                f"{result.finish_reason} {result.usage}"
                            )
                        sizes["http_body"] = len(raw)
                say(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
        await client.close()
        # The hop's own cost for this message, without the engine's noise: protobuf
        # encode (server) and decode (client), and moving the bytes over loopback gRPC.
        hop = await large_message_hop(resp, self.root)
        await local.shutdown()
        self.results["part3"] = {
            "seconds": {k: median(v) for k, v in times.items()},
            "hop_ms": hop,
            "bytes": sizes,
            "reps": reps,
        }

    # -- part 4 --------------------------------------------------------------

    async def part4(self) -> None:
        say("part 4: KV events through the relay into Dynamo's publisher")
        stats_dir = self.root / "kvstats"
        stats_dir.mkdir()
        log = open(self.root / "kv-source.log", "wb")
        source = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_source"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        try:
            assert source.stdin is not None and source.stdout is not None
            address = json.loads(source.stdout.readline())["address"]
            self.start_frontend()
            worker = self.group.spawn(
                "kv-worker",
                [
                    sys.executable,
                    "-m",
                    "bench.kv_worker",
                    str(stats_dir),
                    "--engine",
                    address,
                    "--model-path",
                    str(self.model_dir),
                    "--served-model-name",
                    "kv",
                    "--namespace",
                    "ns-kv",
                    "--log-level",
                    "warning",
                ],
                self.env,
            )
            self.wait_models(["kv"])

            def stats(start: int) -> dict[str, Any]:
                out = stats_dir / "stats.json"
                out.unlink(missing_ok=True)
                (stats_dir / "request").write_text(str(start))
                wait_until(out.exists, 20, "kv worker stats", [worker], interval=0.02)
                return json.loads(out.read_text())

            # Let the relay's subscription and the publisher settle.
            await asyncio.sleep(1.0)
            rows = []
            seen = stats(0)["blocks"]
            rates = (5_000, 10_000, 20_000, 40_000, 80_000)
            seconds = 1.0 if self.args.quick else 2.0
            for rate in rates:
                batch = max(1, rate // 1000)  # about one engine batch per millisecond
                source.stdin.write(f"burst {rate} {seconds} {batch}\n")
                source.stdin.flush()
                line = await asyncio.get_running_loop().run_in_executor(
                    None, source.stdout.readline
                )
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
                # Delivery time: from the first emission to the last arrival.
                row = {
                    "offered_per_s": rate,
                    "emitted": emitted["emitted"],
                    "emitted_per_s": emitted["emitted"] / emitted["seconds"],
                    "delivered": got,
                    "lost": emitted["emitted"] - got,
                    "duplicates": s["duplicates"],
                    "p50_ms": percentile(lat, 50) / 1e6,
                    "p99_ms": percentile(lat, 99) / 1e6,
                    "max_ms": max(lat) / 1e6 if lat else float("nan"),
                }
                rows.append(row)
                say(
                    f"  {rate}/s offered: {row['emitted_per_s']:.0f}/s emitted, "
                    f"lost {row['lost']}, p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms"
                )
            self.results["part4"] = rows
        finally:
            with contextlib.suppress(Exception):
                assert source.stdin is not None
                source.stdin.write("quit\n")
                source.stdin.flush()
            try:
                source.wait(10)
            except subprocess.TimeoutExpired:
                source.kill()
            log.close()

    # -- part 5 --------------------------------------------------------------

    async def part5(self) -> None:
        if importlib.util.find_spec("vllm") is None:
            say("part 5: skipped (vLLM not installed)")
            return
        say("part 5: the vLLM engine server through the whole stack vs AsyncLLM directly")
        vllm_args = [
            "--model",
            str(self.model_dir),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--max-new-tokens",
            str(GEN_TOKENS),
        ]
        self.start_frontend()
        # Both engines load at once (the direct one in the background).
        direct = self.group.spawn(
            "vllm-direct",
            [sys.executable, "-m", "bench.vllm_direct", str(self.root / "direct"), *vllm_args],
        )
        _, address = self.group.engine_server(
            "engine-vllm", *vllm_args, backend="vllm", timeout=600
        )
        self.start_bridge("vllm", address)
        self.wait_models(["vllm"], timeout=600)
        ctl = self.root / "direct"
        wait_until(lambda: (ctl / "ready").exists(), 600, "direct AsyncLLM", [direct])
        concurrency = 16
        n = 48 if self.args.quick else 384
        reps = self.args.reps
        prompts_file = self.root / "prompts.json"
        prompts_file.write_text(json.dumps(self.prompts[:n]))

        def run_direct(rep: int) -> Cell:
            out = ctl / f"result-{rep}.json"
            before = self.cpu_times("vllm-direct")
            (ctl / "request.tmp").write_text(json.dumps([str(prompts_file), concurrency, n, rep]))
            os.replace(ctl / "request.tmp", ctl / "request")
            wait_until(out.exists, 600, "direct AsyncLLM run", [direct], interval=0.05)
            after = self.cpu_times("vllm-direct")
            r = json.loads(out.read_text())
            cell = Cell("direct", concurrency, r["n"], r["seconds"], r["latencies_s"])
            cell.cpu_ms = {k: (after[k] - before[k]) * 1000 / max(cell.n, 1) for k in after}
            return cell

        stack_cells: list[Cell] = []
        direct_cells: list[Cell] = []
        # Warm both.
        await self.http_cells(["vllm"], [concurrency], 1, lambda c: 16, GEN_TOKENS, False)
        await asyncio.get_running_loop().run_in_executor(None, run_direct, -1)
        for rep in range(reps):
            order = ["stack", "direct"] if rep % 2 == 0 else ["direct", "stack"]
            for which in order:
                if which == "stack":
                    cells = await self.http_cells(
                        ["vllm"], [concurrency], 1, lambda c: n, GEN_TOKENS, False
                    )
                    stack_cells.append(cells["vllm"][concurrency][0])
                else:
                    direct_cells.append(
                        await asyncio.get_running_loop().run_in_executor(None, run_direct, rep)
                    )
            say(
                f"  rep {rep + 1}: stack {stack_cells[-1].rps:.1f}/s, "
                f"direct {direct_cells[-1].rps:.1f}/s"
            )
        (ctl / "quit").write_text("")
        self.results["part5"] = {
            "concurrency": concurrency,
            "stack": summarize(stack_cells),
            "direct": summarize(direct_cells),
        }


async def large_message_hop(resp: pb.RolloutResponse, root: Path) -> dict[str, float]:
    """Median milliseconds to encode and decode ``resp``, and to carry its bytes across
    a loopback gRPC call (an echo server in this process, TCP and unix socket)."""
    data = resp.SerializeToString()
    encode, decode = [], []
    for _ in range(7):
        started = time.perf_counter()
        resp.SerializeToString()
        encode.append(time.perf_counter() - started)
        started = time.perf_counter()
        pb.RolloutResponse.FromString(data)
        decode.append(time.perf_counter() - started)
    out = {"encode": median(encode) * 1000, "decode": median(decode) * 1000}
    limit = 64 * 2**20
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]

    async def echo(request: bytes, context: object) -> bytes:
        return data

    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Get": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    sock = root / "echo.sock"
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    try:
        targets = (("transfer_tcp", f"127.0.0.1:{port}"), ("transfer_unix", f"unix:{sock}"))
        for name, target in targets:
            async with grpc.aio.insecure_channel(target, options=options) as channel:
                call = channel.unary_unary("/bench.Echo/Get")
                await call(b"")
                samples = []
                for _ in range(7):
                    started = time.perf_counter()
                    got = await call(b"")
                    samples.append(time.perf_counter() - started)
                    assert len(got) == len(data)
                out[name] = median(samples) * 1000
    finally:
        await server.stop(None)
    return out


# ---------------------------------------------------------------------------
# Report


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def paired(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Median [min-max] of the per-repetition rps ratios b/a."""
    pairs = zip(a.get("rps_reps", []), b.get("rps_reps", []), strict=True)
    ratios = [rb / ra for ra, rb in pairs if ra]
    if not ratios:
        return ""
    return f"{median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def report(results: dict[str, Any]) -> str:
    lines = [
        "# make bench",
        "",
        f"{results['meta']['when']}, {results['meta']['cpus']} CPUs, "
        f"python {results['meta']['python']}; medians over {results['meta']['reps']} "
        "interleaved repetitions. Ratios matter more than absolute numbers "
        "(the machine is shared; the load generator runs on the same cores).",
        "",
    ]
    p1 = results.get("part1")
    if p1:
        lines += [
            "## 1. Rollouts through Dynamo's frontend (sim engine, zero delay, "
            f"{PROMPT_TOKENS}-token prompts, {GEN_TOKENS} tokens out)",
            "",
            "(a) = in-process Dynamo worker; (b) = bridge + engine server over gRPC.",
            "",
            "rps (b)/(a) is the ratio of medians; paired is the median, and the range, "
            "of the ratios within each repetition (the configurations of a repetition "
            "run back to back, so slow drifts in the machine's other load cancel).",
            "",
            "| conc | (a) rps | (a) p50 ms | (a) p99 ms | (b) transport | (b) rps | (b) p50 ms "
            "| (b) p99 ms | rps (b)/(a) | paired | p50 +ms | p99 (b)/(a) |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
        ]
        for c in CONCURRENCY:
            a = p1["inproc"][str(c)]
            for transport in PART1_MODELS[1:]:
                b = p1[transport][str(c)]
                lines.append(
                    f"| {c} | {fmt(a['rps'])} | {fmt(a['p50_ms'], 2)} | {fmt(a['p99_ms'], 2)} "
                    f"| {TRANSPORT_NAMES[transport]} | {fmt(b['rps'])} | {fmt(b['p50_ms'], 2)} "
                    f"| {fmt(b['p99_ms'], 2)} | **{b['rps'] / a['rps']:.2f}** "
                    f"| {paired(a, b)} "
                    f"| **{b['p50_ms'] - a['p50_ms']:+.2f}** | {b['p99_ms'] / a['p99_ms']:.2f} |"
                )
        errors = sum(r["errors"] for per in p1.values() for r in per.values())
        lines += [
            "",
            f"Failed requests (not counted above): {errors}.",
            "",
            "CPU milliseconds per rollout, by process (where the cost goes):",
            "",
            "| conc | config | frontend | worker / bridge | engine server | load generator "
            "| total |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for c in CONCURRENCY:
            for name in PART1_MODELS:
                cpu = p1[name][str(c)].get("cpu_ms") or {}
                if not cpu:
                    continue
                worker = sum(v for k, v in cpu.items() if k.startswith(("worker", "bridge")))
                lines.append(
                    f"| {c} | {TRANSPORT_NAMES.get(name, name)} | {cpu.get('frontend', 0):.2f} "
                    f"| {worker:.2f} "
                    f"| {cpu.get('engine', 0) + cpu.get('engine-children', 0):.2f} "
                    f"| {cpu.get('client', 0):.2f} "
                    f"| {sum(cpu.values()):.2f} |"
                )
        lines.append("")
    p2 = results.get("part2")
    if p2:
        lines += [
            "## 2. The gRPC hop alone (the bridge's EngineClient straight to the engine server)",
            "",
            "CPU ms per rollout: the load generator's process (which runs the engine itself "
            "in the in-process rows) and the engine server's.",
            "",
            "| conc | path | rps | p50 ms | p99 ms | rps vs in-process | client CPU ms "
            "| server CPU ms |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in CONCURRENCY:
            base = p2["in-process"][str(c)]["rps"]
            for name in PART2_PATHS:
                r = p2[name][str(c)]
                cpu = r.get("cpu_ms") or {}
                lines.append(
                    f"| {c} | {TRANSPORT_NAMES.get(name, name)} | {fmt(r['rps'])} "
                    f"| {fmt(r['p50_ms'], 3)} "
                    f"| {fmt(r['p99_ms'], 3)} | {r['rps'] / base:.2f} "
                    f"| {cpu.get('client', 0):.2f} | {cpu.get('engine', 0):.2f} |"
                )
        lines.append("")
    p3 = results.get("part3")
    if p3:
        b, s = p3["bytes"], p3["seconds"]
        lines += [
            f"## 3. One large rollout: {b.get('tokens')} tokens, routed experts "
            f"{b.get('shape')} uint8",
            "",
            "| what | bytes | MiB |",
            "|---|---:|---:|",
            f"| routed experts, raw | {b['routed_experts_raw']:,} "
            f"| {b['routed_experts_raw'] / 2**20:.2f} |",
            f"| raw payload (experts + int32 tokens + float64 logprobs) | {b['raw_payload']:,} "
            f"| {b['raw_payload'] / 2**20:.2f} |",
            f"| gRPC RolloutResponse on the wire | {b['grpc_message']:,} "
            f"| {b['grpc_message'] / 2**20:.2f} |",
            f"| HTTP body from the frontend (JSON, base64) | {b['http_body']:,} "
            f"| {b['http_body'] / 2**20:.2f} |",
            "",
            "| path | seconds (median) | added by the hop |",
            "|---|---:|---:|",
            f"| engine code in this process | {s['in-process']:.3f} | |",
            f"| Rollout RPC (TCP) | {s['grpc']:.3f} | {s['grpc'] - s['in-process']:+.3f} |",
            f"| frontend + in-process worker (a) | {s['http-inproc']:.3f} | |",
            f"| frontend + bridge + engine server (b) | {s['http-grpc']:.3f} "
            f"| {s['http-grpc'] - s['http-inproc']:+.3f} |",
            "",
            "The 16k decode steps take seconds and vary with the machine's load, which "
            "hides the hop in the end-to-end times; the hop alone for this message:",
            "",
            "| protobuf encode (server) | loopback gRPC transfer, TCP | unix socket "
            "| protobuf decode (client) | hop total (TCP) |",
            "|---:|---:|---:|---:|---:|",
        ]
        h = p3["hop_ms"]
        total = h["encode"] + h["transfer_tcp"] + h["decode"]
        lines += [
            f"| {h['encode']:.1f} ms | {h['transfer_tcp']:.1f} ms | {h['transfer_unix']:.1f} ms "
            f"| {h['decode']:.1f} ms | {total:.1f} ms |",
            "",
        ]
    p4 = results.get("part4")
    if p4:
        lines += [
            "## 4. KV events: engine server -> relay -> Dynamo's KvEventPublisher",
            "",
            "One stored block per event, about one engine batch per millisecond; latency "
            "from the engine's publish to the call into Dynamo's publisher.",
            "",
            "| offered ev/s | emitted ev/s | delivered | lost | dup | p50 ms | p99 ms | max ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        best = 0  # the highest rate met, with every lower rate met too
        for r in p4:
            if r["lost"] or r["duplicates"] or not r["p99_ms"] <= 100:
                break
            best = r["offered_per_s"]
        lines[-4:-4] = [
            f"Sustained with nothing lost and p99 <= 100 ms: **{best:,} events/s** "
            "(the highest offered rate that met both).",
            "",
        ]
        for r in p4:
            lines.append(
                f"| {r['offered_per_s']:,} | {fmt(r['emitted_per_s'], 0)} | {r['delivered']:,} "
                f"| {r['lost']} | {r['duplicates']} | {fmt(r['p50_ms'], 2)} "
                f"| {fmt(r['p99_ms'], 2)} | {fmt(r['max_ms'], 2)} |"
            )
        lines.append("")
    p5 = results.get("part5")
    if p5:
        st, d = p5["stack"], p5["direct"]
        lines += [
            f"## 5. vLLM (CPU, tiny model), concurrency {p5['concurrency']}, "
            f"{GEN_TOKENS} tokens out",
            "",
            "| path | rps | p50 ms | p99 ms |",
            "|---|---:|---:|---:|",
            f"| AsyncLLM called directly | {fmt(d['rps'], 2)} | {fmt(d['p50_ms'])} "
            f"| {fmt(d['p99_ms'])} |",
            f"| frontend + bridge + vLLM engine server | {fmt(st['rps'], 2)} "
            f"| {fmt(st['p50_ms'])} | {fmt(st['p99_ms'])} |",
            f"| **ratio** | **{st['rps'] / d['rps']:.2f}** | | |",
            "",
            "CPU ms per rollout, by process:",
            "",
            "| path | frontend | bridge | engine server / direct driver | vLLM EngineCore "
            "| load generator | total |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in (("direct", d), ("stack", st)):
            cpu = r.get("cpu_ms") or {}
            owner = cpu.get("engine", 0.0) + cpu.get("worker", 0.0)
            core = cpu.get("engine-children", 0.0) + cpu.get("worker-children", 0.0)
            lines.append(
                f"| {name} | {cpu.get('frontend', 0):.1f} | {cpu.get('bridge', 0):.1f} "
                f"| {owner:.1f} | {core:.1f} | {cpu.get('client', 0):.1f} "
                f"| {sum(cpu.values()):.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    parts = [int(p) for p in args.parts.split(",")]
    with stack_dir(args.keep_logs) as root, ProcessGroup(root / "logs") as group:
        bench = Bench(args, root, group)
        bench.results["meta"] = {
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "reps": args.reps,
            "quick": args.quick,
        }
        started = time.monotonic()
        for part in parts:
            await getattr(bench, f"part{part}")()
            say(f"  ({time.monotonic() - started:.0f}s so far)")
            if part == 2 or (part == 1 and 2 not in parts):
                bench.stop(
                    "worker-inproc", "bridge-grpc-tcp", "bridge-grpc-unix", "bridge-unary-tcp"
                )
                bench.stop("engine-tcp", "engine-unix")
            elif part == 3:
                bench.stop("worker-large-inproc", "bridge-large-grpc", "engine-large")
            elif part == 4:
                bench.stop("kv-worker")
        bench.results["meta"]["seconds"] = time.monotonic() - started
        return bench.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default="4,1,2,3,5", help="which parts, in this order (default: all)"
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
    args = parser.parse_args(argv)
    try:
        import uvloop  # as Dynamo's workers and the engine server run

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        results = runner.run(main_async(args))
    text = report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    (args.out / "bench.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwritten to {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
