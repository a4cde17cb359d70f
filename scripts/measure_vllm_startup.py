"""Measure the vLLM engine server's start-up time and peak memory with the tiny model.

Runs the real CLI (``python -m engine_server --backend vllm ...``) as a child
process, as a deployment would, and reports:

- ready_s: process start until the engine is ready (its ``--ready-file`` appears;
  the gRPC port is bound earlier, NOT_SERVING meanwhile);
- first_rollout_s: one greedy 16-token Rollout over gRPC, right after;
- shutdown_s: SIGTERM until the process tree is gone;
- peak_rss_mib: the largest sum of RSS over the server and all its descendants
  (vLLM's EngineCore process included), sampled every 50 ms.

    python -m scripts.measure_vllm_startup [--runs 1] [--kv-cache-mib 64] [--json]

Extra arguments after ``--`` go to the server (e.g. ``-- --dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent


class TreeRss:
    """Peak summed RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self._proc = psutil.Process(pid)
        self._every = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        total = 0
        try:
            procs = [self._proc, *self._proc.children(recursive=True)]
        except psutil.Error:
            return 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def rollout(address: str) -> float:
    import grpc

    from engine_contract.v1 import engine_pb2 as pb
    from engine_contract.v1 import engine_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        t0 = time.monotonic()
        resp = stub.Rollout(
            pb.RolloutRequest(
                request_id="measure-1",
                prompt_token_ids=list(range(3, 40)),
                greedy=True,
                max_new_tokens=16,
            ),
            timeout=60,
        )
        took = time.monotonic() - t0
    assert len(resp.token_ids) == len(resp.logprobs) > 0, resp
    return took


def measure_once(model: Path, kv_mib: int, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        cmd = [
            sys.executable, "-m", "engine_server", "--backend", "vllm",
            "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--log-level", "warning",
            "--model", str(model), "--max-model-len", "512", "--dtype", "float32",
            "--enforce-eager", "--block-size", "32",
            "--kv-cache-memory-bytes", str(kv_mib << 20), *extra,
        ]  # fmt: skip
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        rss = TreeRss(proc.pid)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {proc.returncode}:\n{proc.stderr.read()}"
                    )
                if time.monotonic() - t0 > 300:
                    raise TimeoutError("engine server not ready after 300 s")
                time.sleep(0.05)
            ready_s = time.monotonic() - t0
            ready_rss = rss.now()
            first_rollout_s = rollout(ready.read_text().strip())
            descendants = proc_tree(proc.pid)
            t1 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            psutil.wait_procs(descendants, timeout=30)
            shutdown_s = time.monotonic() - t1
        finally:
            rss.stop()
            if proc.poll() is None:
                proc.kill()
    return {
        "ready_s": round(ready_s, 2),
        "first_rollout_s": round(first_rollout_s, 3),
        "shutdown_s": round(shutdown_s, 2),
        "ready_rss_mib": round(ready_rss / 2**20),
        "peak_rss_mib": round(rss.peak / 2**20),
    }


def proc_tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--model", type=Path, default=ROOT / ".artifacts" / "tiny-model")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    from harness.tiny_model import build_tiny_model

    model = build_tiny_model(args.model)
    runs = [measure_once(model, args.kv_cache_mib, extra) for _ in range(args.runs)]
    summary: dict[str, Any] = {
        "runs": runs,
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]},
        "cpus": os.cpu_count(),
        "kv_cache_mib": args.kv_cache_mib,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VLLM_", "TORCH"))},
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    for i, r in enumerate(runs):
        print(f"run {i + 1}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    med = summary["median"]
    print(
        f"median of {len(runs)}: ready {med['ready_s']} s, first rollout "
        f"{med['first_rollout_s']} s, shutdown {med['shutdown_s']} s, peak RSS "
        f"{med['peak_rss_mib']} MiB (process tree), {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
