"""Shared pieces of the fault tests: one stack of real processes (sim engine
servers, bridges with vllm/torch unimportable, one Dynamo frontend), concurrent
HTTP load through the frontend, engine load, and a record of measured figures."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from procs import (
    ROOT,
    Proc,
    ProcessGroup,
    blocking_env,
    dynamo_env,
    registered_workers,
    wait_for_model,
    wait_until,
)

from bridge import driver
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc

# Long requests: EOS never likeliest, 20 ms per decode step.
LONG_SIM_ARGS = (
    "--eos-rate",
    "0",
    "--decode-step-ms",
    "20",
    "--block-size",
    "16",
    "--num-kv-blocks",
    "20000",
)
FIGURES = ROOT / ".artifacts" / "faults"


def record(name: str, **figures: Any) -> None:
    """Print measured figures and keep them in .artifacts/faults/<name>.json."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\n[faults] {name}: {json.dumps(figures)}", flush=True)


@dataclass
class Stack:
    root: Path
    group: ProcessGroup
    model: str
    model_dir: Path
    namespace: str
    env: dict[str, str]
    engines: list[tuple[Proc, str]] = field(default_factory=list)
    bridges: list[Proc] = field(default_factory=list)
    frontend: Proc | None = None
    base_url: str = ""

    @property
    def kv_dir(self) -> Path:
        return self.root / "kv"

    @property
    def procs(self) -> list[Proc]:
        return (
            [p for p, _ in self.engines] + self.bridges + ([self.frontend] if self.frontend else [])
        )

    def bridge_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, **blocking_env("vllm", "torch"), **extra}

    def start_engine(
        self,
        name: str,
        *args: str,
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        launcher: Sequence[str] = (),
    ) -> tuple[Proc, str]:
        engine = self.group.engine_server(
            name,
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            *args,
            listen=listen,
            env=env,
            launcher=launcher,
        )
        self.engines.append(engine)
        return engine

    def start_bridge(
        self, name: str, address: str, *args: str, launcher: Sequence[str] = (), **env: str
    ) -> Proc:
        bridge = self.group.bridge(
            name,
            address,
            self.model_dir,
            self.model,
            self.namespace,
            self.bridge_env(**env),
            *args,
            launcher=launcher,
        )
        self.bridges.append(bridge)
        return bridge

    def start_frontend(self, *args: str, port: int | None = None) -> Proc:
        self.frontend, self.base_url = self.group.frontend(
            f"frontend-{len([p for p in self.group.procs if p.name.startswith('frontend')])}",
            self.env,
            *args,
            port=port,
        )
        return self.frontend

    def wait_serving(self, workers: int = 1, timeout: float = 90.0) -> None:
        procs = [p for p in self.procs if p.alive()]
        wait_until(
            lambda: registered_workers(self.kv_dir, self.namespace) >= workers,
            timeout,
            f"{workers} workers registered",
            procs,
        )
        wait_for_model(self.base_url, self.model, procs, timeout)


def new_stack(root: Path, group: ProcessGroup, model_dir: Path, model: str) -> Stack:
    # Letters and digits only: file discovery percent-encodes the rest in its file names.
    namespace = "ns" + "".join(c for c in model if c.isalnum())
    return Stack(root, group, model, model_dir, namespace, dynamo_env(root / "kv"))


# -- engine server side --------------------------------------------------------


def load(address: str) -> pb.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.EngineServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_load(address: str, predicate: Any, timeout: float, interval: float = 0.02) -> float:
    """Seconds until ``predicate(GetLoad)`` holds (TimeoutError with the last load if not)."""
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        while True:
            last = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
            if predicate(last):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"load not reached within {timeout}s: {last}")
            time.sleep(interval)


def snapshot_blocks(address: str) -> int:
    """Blocks in the engine's KV cache, from a SubscribeKvEvents snapshot."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        call = stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(include_snapshot=True), timeout=10
        )
        blocks = 0
        try:
            for response in call:
                batch = response.batch
                blocks += sum(
                    len(e.stored.block_hashes) for e in batch.events if e.HasField("stored")
                )
                if not batch.HasField("snapshot") or batch.snapshot.last:
                    break
        finally:
            call.cancel()
        return blocks


def idle(load: pb.GetLoadResponse) -> bool:
    return (
        load.running_requests == 0
        and load.waiting_requests == 0
        and (load.registered_requests == 0)
    )


# -- HTTP load through the frontend ---------------------------------------------


@dataclass
class Outcome:
    """How one HTTP request ended: status (0: no answer), error text, when it ended."""

    status: int
    ended: float
    body: Any = None
    error: str = ""
    stream_error_code: int | None = None


# Six full blocks of 16: what the KV router scores.
KV_PROMPT = [(i * 37) % 800 + 5 for i in range(96)]


async def kv_hit_rate(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    check: bool = True,
    tokens: Sequence[int] = KV_PROMPT,
) -> float | None:
    """The router's KV hit rate for ``tokens`` plus one token (None: not served)."""
    body = {
        "model": model,
        "prompt": [*tokens, 999],
        "max_tokens": 2,
        "nvext": {"extra_fields": ["timing"]},
    }
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200 and not check:
            return None
        assert resp.status == 200, answer
    return float(answer["nvext"]["timing"].get("kv_hit_rate") or 0.0)


def kv_prompt(seed: int) -> list[int]:
    """Six full blocks of 16, different per seed."""
    return [(seed * 97 + i * 37) % 800 + 5 for i in range(96)]


async def wait_kv_hit(
    session: aiohttp.ClientSession, base_url: str, model: str, tokens: Sequence[int]
) -> float:
    """Poll until the router scores hits for ``tokens`` (KV events travel asynchronously)."""
    deadline = time.monotonic() + 15
    while True:
        hit = await kv_hit_rate(session, base_url, model, tokens=tokens)
        if hit or time.monotonic() > deadline:
            return hit or 0.0
        await asyncio.sleep(0.2)


def prompt(seed: int, length: int = 40) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 3 for i in range(length)]


async def rollout(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    tokens: Sequence[int],
    max_tokens: int,
    timeout: float = 60.0,
    **kwargs: Any,
) -> Outcome:
    kwargs.setdefault("greedy", True)
    body = driver.build_rollout_body(model, tokens, max_tokens=max_tokens, **kwargs)
    return await post(session, f"{base_url}/v1/completions", body, timeout)


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, timeout: float = 60.0
) -> Outcome:
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return Outcome(resp.status, time.monotonic(), parsed)
    except (TimeoutError, aiohttp.ClientError) as e:
        return Outcome(0, time.monotonic(), error=f"{type(e).__name__}: {e}")


async def stream(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    tokens: Sequence[int],
    max_tokens: int,
    timeout: float = 60.0,
) -> Outcome:
    """A streamed completion; an SSE error event's code is kept (HTTP status is 200 by then)."""
    body = {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": max_tokens,
        "stream": True,
        # Greedy: with the sim's --eos-rate 0, EOS is never the likeliest token.
        "temperature": 0,
    }
    code: int | None = None
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                return Outcome(resp.status, time.monotonic(), await resp.text())
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    code = int(event["error"].get("code") or 500)
            return Outcome(resp.status, time.monotonic(), stream_error_code=code)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return Outcome(
            0, time.monotonic(), error=f"{type(e).__name__}: {e}", stream_error_code=code
        )
