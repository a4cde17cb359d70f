"""GetLoad's latency as another client sees it, from a process of its own.

    python tests/server/getload_probe.py ADDRESS OUT.json [INTERVAL_S]

Connects, makes one call (the connection's set-up is not measured), prints
``ready`` and then asks GetLoad every INTERVAL_S (default 0.01) until SIGTERM;
then writes {"calls", "errors", "worst_ms", "worst_at", "latencies_ms",
"started_at"} to OUT.json (``*_at``: ``time.monotonic()`` when a call started,
the system-wide clock the test reads too). A call that fails (or takes longer
than 30 s) counts as an error, with its latency.
Run as a separate process so that the test's own client work (building or
reading a flood of messages) weighs on none of the measurements.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc


def main() -> None:
    address, out = sys.argv[1], Path(sys.argv[2])
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    latencies: list[float] = []
    starts: list[float] = []
    errors: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        stub.GetLoad(pb.GetLoadRequest(), timeout=30)
        print("ready", flush=True)
        while not stop:
            starts.append(time.monotonic())
            started = time.perf_counter()
            try:
                stub.GetLoad(pb.GetLoadRequest(), timeout=30)
            except grpc.RpcError as e:
                errors.append(f"{e.code()}: {e.details()}")
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(interval)
    worst = max(range(len(latencies)), key=latencies.__getitem__, default=None)
    out.write_text(
        json.dumps(
            {
                "calls": len(latencies),
                "errors": errors,
                "worst_ms": latencies[worst] if worst is not None else 0.0,
                "worst_at": starts[worst] if worst is not None else 0.0,
                "latencies_ms": [round(x, 2) for x in latencies],
                "started_at": [round(x, 4) for x in starts],
            }
        )
    )


if __name__ == "__main__":
    main()
