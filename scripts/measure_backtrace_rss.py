"""What a Dynamo process's first Rust backtraces cost in memory: the frontend's RSS
(anonymous and file-backed) before and after a bridge is SIGKILLed with 16
streams in flight, three times over, with Rust backtraces on or off.

Dynamo's frontend logs each stream it cannot migrate as an error with a stack
backtrace where ``RUST_BACKTRACE`` (or ``RUST_LIB_BACKTRACE``) is set; the first
one makes Rust's symbolizer read Dynamo's library's symbols and keep them.

    python -m scripts.measure_backtrace_rss [--backtraces on|off] [--rounds 3]

Prints a JSON line a round: RSS, RssAnon and RssFile (MiB) before and after the
kill, and the backtraces the frontend had logged by then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
from pathlib import Path

import aiohttp

from harness.engine import long_sim_args
from harness.http import post_stream, stream_body
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir

MODEL = "tiny-backtrace"
STREAMS = 16


def memory_mib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile from /proc/PID/status, in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {k: int(fields[k].split()[0]) >> 10 for k in ("VmRSS", "RssAnon", "RssFile")}


async def measure(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp) / "logs") as group:
        stack = Stack.new(Path(tmp), group, tiny_model_dir(), MODEL)
        _, address = stack.start_engine("engine", *long_sim_args(decode_step_ms=20))
        frontend = stack.start_frontend()
        url = f"{stack.base_url}/v1/completions"
        async with aiohttp.ClientSession() as session:
            for round_ in range(rounds):
                bridge = stack.start_bridge(f"bridge-{round_}", address)
                stack.wait_serving(workers=1)
                for _ in range(3):  # warm: the frontend's own buffers reach their size
                    short = (stream_body(MODEL, [5, 6, i], 8) for i in range(STREAMS))
                    await asyncio.gather(*(post_stream(session, url, body) for body in short))
                await asyncio.sleep(2)
                before = memory_mib(frontend.pid)
                long = (stream_body(MODEL, [5, 6, i], 400) for i in range(STREAMS))
                streams = [asyncio.create_task(post_stream(session, url, body)) for body in long]
                await asyncio.sleep(1.5)
                os.kill(bridge.pid, signal.SIGKILL)
                await asyncio.gather(*streams, return_exceptions=True)
                await asyncio.sleep(3)
                logged = frontend.log_path.read_text(errors="replace").count("Stack backtrace:")
                after = memory_mib(frontend.pid)
                print(
                    json.dumps(
                        {
                            "round": round_,
                            "before_mib": before,
                            "after_mib": after,
                            "backtraces_logged": logged,
                        }
                    ),
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backtraces", choices=("on", "off"), default="on")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    value = "1" if args.backtraces == "on" else "0"
    os.environ.update(RUST_BACKTRACE=value, RUST_LIB_BACKTRACE=value)  # the processes inherit it
    asyncio.run(measure(args.rounds))


if __name__ == "__main__":
    main()
