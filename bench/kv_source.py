"""Part 4 of ``make bench``: an engine server whose KV events come at a set rate.

A real engine server (``engine_server.serve``) on the simulated engine; the
events go through the same path as the engine's own (``KvEventHub.publish``),
at a paced rate. Each stored block's hash is its emission time in
nanoseconds (strictly increasing), so the receiving side can time it.

Reads commands on stdin, answers one JSON line each on stdout:
    burst RATE SECONDS BATCH   -> {"emitted": N, "seconds": S}
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable

from engine_server import ServerConfig, serve
from engine_server.backends.base import BlockStored, KvEventBatch
from engine_server.backends.sim import SimBackend

BLOCK_SIZE = 16


async def burst(
    hub_publish: Callable[[KvEventBatch], object],
    rate: float,
    seconds: float,
    batch: int,
    state: dict[str, int],
) -> dict[str, float]:
    tokens = tuple(range(BLOCK_SIZE))
    emitted = 0
    started = time.perf_counter()
    end = started + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        due = int(rate * (now - started)) - emitted
        while due > 0:
            events: list[BlockStored] = []
            for _ in range(min(batch, due)):
                h = max(time.time_ns(), state["last"] + 1)
                state["last"] = h
                events.append(BlockStored((h,), None, tokens, BLOCK_SIZE))
            hub_publish(KvEventBatch(tuple(events), timestamp_unix_nanos=time.time_ns()))
            emitted += len(events)
            due -= len(events)
        await asyncio.sleep(0.001)
    return {"emitted": emitted, "seconds": time.perf_counter() - started}


async def main() -> None:
    backend = SimBackend(zero_delay=True, block_size=BLOCK_SIZE)
    handle = await serve(
        backend, ServerConfig(listen=sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:0")
    )
    print(json.dumps({"address": handle.address}), flush=True)
    loop = asyncio.get_running_loop()
    state = {"last": 0}
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            break
        _, rate, seconds, batch = line.split()
        result = await burst(handle.kv_hub.publish, float(rate), float(seconds), int(batch), state)
        print(json.dumps(result), flush=True)
    await handle.stop(grace_period_s=0)


if __name__ == "__main__":
    asyncio.run(main())
