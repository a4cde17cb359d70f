"""Soak: a bounded run of mixed traffic against simulated engine servers, through
bridges and Dynamo's frontend, checking for leaked requests and memory growth.

    python -m scripts.soak --duration-s 600    # make soak
    python -m scripts.soak --duration-s 60     # the slow test in make test

Traffic (``--clients`` concurrent loops until the duration ends): rollouts,
streamed completions read to the end, streams the client drops after a few
chunks (a disconnect: Dynamo calls the bridge's abort), rollouts the client
gives up on (a disconnect before any answer), and rollouts aborted on the engine
server by request id (gRPC Abort).

Pass when, at the end: every engine server's GetLoad says 0 running, 0 waiting
and 0 registered; no request got an unexpected answer; and the RSS of every
engine server and bridge is flat: the median of the samples in the last window
is within ``--rss-tolerance`` of the median in the first window after warm-up
(medians, so one GC swing or allocator burst does not decide). Prints the
figures and writes them to ``--out`` (JSON). Exit status 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import psutil

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness import ARTIFACTS
from harness.engine import idle, wait_load_async
from harness.procs import Proc, ProcessGroup, rss_bytes
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import WaitTimeout
from rl_client import driver

MODEL = "tiny-soak"
NAMESPACE = "soak"
# A small KV replay buffer: bounded buffers must fill during the warm-up, so
# that growth after it means a leak (the default 10k batches take minutes).
SIM_ARGS = (
    "--eos-rate",
    "0.02",
    "--decode-step-ms",
    "3",
    "--block-size",
    "16",
    "--kv-replay-batches",
    "500",
)
KINDS = ("rollout", "stream", "stream_drop", "rollout_drop", "engine_abort")


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def bad(self, kind: str, what: str) -> None:
        self.counts[f"{kind}:unexpected"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {what}"[:300])


def prompt(rng: random.Random) -> list[int]:
    # Shared prefixes (a few families) so the prefix cache and KV events churn.
    family = rng.randrange(8)
    head = [(family * 131 + i * 17) % 900 + 3 for i in range(32)]
    return head + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 40))]


async def one(
    kind: str,
    session: aiohttp.ClientSession,
    base: str,
    stubs: list[pb_grpc.EngineServiceStub],
    rng: random.Random,
    tally: Tally,
) -> None:
    url = f"{base}/v1/completions"
    tokens = prompt(rng)
    if kind == "rollout":
        body = driver.build_rollout_body(MODEL, tokens, max_tokens=rng.randrange(1, 64))
        async with session.post(url, json=body) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                tally.bad(kind, f"{resp.status} {answer}")
            else:
                driver.parse_rollout_response(answer)
    elif kind in ("stream", "stream_drop"):
        body = {
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": rng.randrange(8, 128),
            "stream": True,
        }
        keep = rng.randrange(1, 4) if kind == "stream_drop" else None
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                tally.bad(kind, f"{resp.status} {await resp.text()}")
                return
            chunks = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and "error" in line:
                    tally.bad(kind, line)
                chunks += line.startswith("data:")
                if keep is not None and chunks >= keep:
                    resp.close()  # drop the connection mid-stream
                    break
    elif kind == "rollout_drop":
        body = driver.build_rollout_body(MODEL, tokens, max_tokens=rng.randrange(64, 256))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.01, 0.3)):
                async with session.post(url, json=body) as resp:
                    await resp.read()
    elif kind == "engine_abort":
        request_id = f"soak-{uuid.uuid4().hex}"
        body = driver.build_rollout_body(
            MODEL, tokens, max_tokens=rng.randrange(128, 512), request_id=request_id
        )
        task = asyncio.create_task(session.post(url, json=body))
        await asyncio.sleep(rng.uniform(0.01, 0.3))
        for stub in stubs:  # it runs on one of them; the others answer NOT_FOUND
            await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5)
        async with await task as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                tally.bad(kind, f"{resp.status} {answer}")
            elif driver.parse_rollout_response(answer).finish_reason not in (
                "aborted",
                "stop",
                "length",
            ):
                tally.bad(kind, str(answer))


async def client_loop(
    seed: int,
    deadline: float,
    base: str,
    stubs: list[pb_grpc.EngineServiceStub],
    tally: Tally,
) -> None:
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, weights=(4, 2, 2, 1, 1))[0]
            try:
                await one(kind, session, base, stubs, rng, tally)
                tally.counts[kind] += 1
            except (aiohttp.ClientError, grpc.aio.AioRpcError, driver.WireError, ValueError) as e:
                tally.bad(kind, f"{type(e).__name__}: {e}")


async def sample_rss(
    procs: dict[str, Proc], deadline: float, interval: float, samples: dict[str, list]
) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        now = time.monotonic() - start
        for name, proc in procs.items():
            samples[name].append((now, rss_bytes(proc.pid)))
        await asyncio.sleep(interval)


def rss_figures(
    samples: list[tuple[float, int]], duration: float, warmup: float, window: float
) -> dict[str, Any]:
    first = [r for t, r in samples if warmup <= t < warmup + window]
    last = [r for t, r in samples if t >= duration - window]
    if not first or not last:
        return {"error": "too few samples"}
    a, b = statistics.median(first), statistics.median(last)
    steps = ((r1 - r0, t1) for (_, r0), (t1, r1) in itertools.pairwise(samples))
    step, step_at = max(steps, default=(0, 0.0))
    return {
        "first_window_median_mib": round(a / 2**20, 1),
        "last_window_median_mib": round(b / 2**20, 1),
        "growth_pct": round(100.0 * (b - a) / a, 2),
        "samples": len(samples),
        "largest_step_mib": round(step / 2**20, 1),
        "largest_step_at_s": round(step_at, 1),
    }


async def final_loads(addresses: list[str], settle_s: float) -> list[dict[str, int]]:
    """Each engine's load once it settles (aborts and disconnects propagate)."""
    loads = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            try:
                load = await wait_load_async(stub, idle, settle_s, interval=0.1)
            except WaitTimeout as e:
                load = e.last  # the leak, reported below
            loads.append(
                {
                    "running": load.running_requests,
                    "waiting": load.waiting_requests,
                    "registered": load.registered_requests,
                }
            )
    return loads


# Off for the soak's processes. The first time a Dynamo process logs an error with a
# Rust backtrace (a bridge's broken pipe on a stream the frontend dropped, where
# RUST_BACKTRACE is set, as on this project's machines), Rust's symbolizer reads and
# keeps the symbols of Dynamo's 226 MB library: about 54 MiB more RSS at once, then
# flat (measured: docs/testing.md), which a minute's windows would read as a leak.
RUST_BACKTRACES_OFF = {"RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}


async def soak(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    os.environ.update(RUST_BACKTRACES_OFF)  # inherited by every process started below
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, tiny_model_dir(), MODEL, NAMESPACE)
        addresses: list[str] = []
        watched: dict[str, Proc] = {}
        for i in range(args.engines):
            engine, address = stack.start_engine(f"engine-{i}", "--seed", str(i), *SIM_ARGS)
            addresses.append(address)
            watched[f"engine-{i}"] = engine
            watched[f"bridge-{i}"] = stack.start_bridge(f"bridge-{i}", address)
        watched["frontend"] = stack.start_frontend("--router-mode", "kv")
        stack.wait_serving(workers=args.engines, timeout=90)
        backtraces = {
            name: psutil.Process(proc.pid).environ().get("RUST_BACKTRACE")
            for name, proc in watched.items()
        }
        base = stack.base_url

        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        stubs = [pb_grpc.EngineServiceStub(c) for c in channels]
        tally = Tally()
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in watched}
        started = time.monotonic()
        deadline = started + args.duration_s
        await asyncio.gather(
            sample_rss(watched, deadline, args.sample_interval_s, samples),
            *(client_loop(seed, deadline, base, stubs, tally) for seed in range(args.clients)),
        )
        elapsed = time.monotonic() - started
        for channel in channels:
            await channel.close()
        loads = await final_loads(addresses, settle_s=10.0)
        alive = {name: proc.alive() for name, proc in watched.items()}

    duration = args.duration_s
    warmup = args.warmup_fraction * duration
    window = args.window_fraction * duration
    rss = {name: rss_figures(s, duration, warmup, window) for name, s in samples.items()}
    checked = [name for name in rss if not name.startswith("frontend")]
    worst = max(abs(rss[n].get("growth_pct", 1e9)) for n in checked)
    total = sum(v for k, v in tally.counts.items() if ":" not in k)
    leaked = sum(sum(load.values()) for load in loads)
    figures: dict[str, Any] = {
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "engines": args.engines,
        "requests": total,
        "requests_per_s": round(total / elapsed, 1),
        "by_kind": dict(sorted(tally.counts.items())),
        "unexpected": tally.unexpected,
        "final_loads": loads,
        "leaked_requests": leaked,
        "all_alive": all(alive.values()),
        "rss_method": (
            f"RSS every {args.sample_interval_s}s; median of [{warmup:.0f}s, "
            f"{warmup + window:.0f}s) vs median of the last {window:.0f}s"
        ),
        "rss": rss,
        "rust_backtrace_by_process": backtraces,
        "worst_rss_growth_pct": worst,
        "rss_tolerance_pct": 100 * args.rss_tolerance,
    }
    figures["passed"] = (
        leaked == 0
        and not tally.unexpected
        and figures["all_alive"]
        and worst <= 100 * args.rss_tolerance
        and total > 0
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--sample-interval-s", type=float, default=0.5)
    parser.add_argument("--warmup-fraction", type=float, default=0.3)
    parser.add_argument("--window-fraction", type=float, default=0.2)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--out", type=Path, default=ARTIFACTS / "soak.json")
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the processes' logs when the soak passes (a failed one keeps them)",
    )
    args = parser.parse_args(argv)
    if args.warmup_fraction + 2 * args.window_fraction > 1:
        parser.error("warm-up plus two windows must fit in the duration")

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        figures = asyncio.run(soak(args, root))
    except BaseException:
        print(f"soak ended early; logs in {root / 'logs'}", file=sys.stderr)
        raise
    if figures["passed"] and not args.keep_logs:
        shutil.rmtree(root, ignore_errors=True)
    else:
        figures["logs"] = str(root / "logs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    print(f"soak {'PASSED' if figures['passed'] else 'FAILED'} (figures in {args.out})")
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
