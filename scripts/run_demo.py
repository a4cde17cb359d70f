"""``make run``: the whole path on one machine, end to end.

Builds the tiny model, starts an engine server (vLLM on CPU/GPU, or the
simulated engine), a Dynamo bridge and a Dynamo frontend on loopback with file
discovery, sends sample rollouts through the frontend with the driver client,
prints the results and the time to the first rollout, and stops everything on
exit, Ctrl-C or SIGTERM.

    python scripts/run_demo.py [--engine vllm|sim] [--model DIR] [--rollouts N] [--keep-logs]

``--model DIR``: your own model folder (HF layout: config.json, tokenizer.json,
tokenizer_config.json, weights), with or without a chat template; the default
is a tiny model built offline. The engine server runs with no flag beyond the
model and the rollout budget: what works here works for you as written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bridge.driver import RolloutClient, RolloutResult  # noqa: E402

NAMESPACE = "demo"
PROMPTS = (
    "Once upon a time",
    "The quick brown fox",
    "In a galaxy far away",
    "Hello there, friend",
)
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", flush=True)


def default_engine() -> str:
    has_backend = (ROOT / "engine_server" / "backends" / "vllm" / "backend.py").exists()
    return "vllm" if has_backend and importlib.util.find_spec("vllm") is not None else "sim"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Children in their own sessions (so Ctrl-C reaches only us), stopped in reverse."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        log.close()
        self.children.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")

    def stop_all(self) -> None:
        for name, proc in reversed(self.children):
            if proc.poll() is None:
                say(f"stopping {name} (pid {proc.pid})")
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.children.clear()


def wait_for(predicate: object, what: str, procs: Processes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        procs.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s (logs: {procs.log_dir})")
        time.sleep(0.1)


def model_listed(base_url: str, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as resp:
            return any(m.get("id") == name for m in json.load(resp).get("data", []))
    except OSError:
        return False


def engine_argv(engine: str, model_dir: Path, name: str, ready_file: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "engine_server",
        "--backend",
        engine,
        "--listen",
        "127.0.0.1:0",
        "--ready-file",
        str(ready_file),
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--max-new-tokens",
        "32",
    ]
    if engine == "sim":
        argv += ["--routed-experts", "2,2,8", "--eos-rate", "0.02"]
    return argv


def show(i: int, prompt: str, result: RolloutResult, tokenizer: object, seconds: float) -> None:
    text = tokenizer.decode(result.token_ids)  # type: ignore[attr-defined]
    print(
        f"  rollout {i}: {len(result.token_ids)} tokens in {seconds * 1000:.0f} ms, "
        f"finish={result.finish_reason} truncated={result.truncated} "
        f"stop={result.stop_reason!r}"
    )
    print(f"    prompt   {prompt!r}")
    print(f"    output   {text[:100]!r}")
    print(f"    tokens   {result.token_ids[:12]}{' ...' if len(result.token_ids) > 12 else ''}")
    print(
        f"    logprobs {[round(x, 4) for x in result.logprobs[:6]]}"
        f"{' ...' if len(result.logprobs) > 6 else ''}"
    )
    if result.routed_experts is not None:
        experts = result.routed_experts
        print(f"    routed experts {experts.dtype} {list(experts.shape)}, r3 {result.r3_stats}")


async def send_rollouts(base_url: str, model_dir: Path, name: str, count: int) -> float:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    first = 0.0
    async with RolloutClient(base_url, name, timeout_s=120) as client:
        for i in range(count):
            prompt = PROMPTS[i % len(PROMPTS)]
            ids = tokenizer.encode(prompt).ids
            kwargs: dict[str, object] = {"greedy": i % 2 == 0, "max_tokens": 16 + 8 * (i % 3)}
            if i == 2:
                kwargs["stop_strings"] = ["."]
            started = time.monotonic()
            result = await client.rollout(ids, **kwargs)  # type: ignore[arg-type]
            if i == 0:
                first = time.monotonic() - T0
                say(f"first rollout back: {first:.1f}s after start")
            show(i, prompt, result, tokenizer, time.monotonic() - started)
    return first


def run(engine: str, model: Path | None, rollouts: int, keep_logs: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="dynamo-demo-"))
    logs = work / "logs"
    logs.mkdir()
    procs = Processes(logs)
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(work / "kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    ok = False
    try:
        if model is None:
            say("[1/5] building the tiny model")
            sys.path.insert(0, str(ROOT / "scripts"))
            from build_tiny_model import build_tiny_model

            model_dir = build_tiny_model(ROOT / ".artifacts" / "tiny-model")
            name = "tiny"
        else:
            say("[1/5] using your model folder")
            model_dir, name = model.resolve(), model.resolve().name
        say(f"      model at {model_dir}, served as {name!r}")

        say(f"[2/5] starting the engine server ({engine}); logs in {logs}")
        ready = work / "engine.addr"
        procs.start("engine", engine_argv(engine, model_dir, name, ready), {})
        wait_for(
            lambda: ready.exists() and ready.read_text().strip(), "engine server address", procs, 60
        )
        address = ready.read_text().strip()
        say(f"      listening on {address}")

        say("[3/5] starting the bridge (waits for the engine to be ready)")
        procs.start(
            "bridge",
            [
                sys.executable,
                "-m",
                "bridge",
                "--engine",
                address,
                "--model-path",
                str(model_dir),
                "--served-model-name",
                name,
                "--namespace",
                NAMESPACE,
            ],
            env,
        )

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        say(f"[4/5] starting the Dynamo frontend on {base_url}")
        procs.start(
            "frontend",
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
            ],
            env,
        )
        wait_for(
            lambda: model_listed(base_url, name),
            f"model {name!r} at the frontend",
            procs,
            600 if engine == "vllm" else 120,
        )
        say("      model registered")

        say(f"[5/5] sending {rollouts} rollouts")
        first = asyncio.run(send_rollouts(base_url, model_dir, name, rollouts))
        print(f"\nTime to first rollout: {first:.1f} s (engine: {engine})")
        ok = True
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        if engine == "vllm":
            print("(try: python scripts/run_demo.py --engine sim)", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            procs.stop_all()
        if ok and not keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {logs}")


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engine",
        choices=["vllm", "sim"],
        default=default_engine(),
        help="engine server backend (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="your model folder (default: a tiny model built offline)",
    )
    parser.add_argument("--rollouts", type=int, default=4, help="how many (default: 4)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    return run(args.engine, args.model, args.rollouts, args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
