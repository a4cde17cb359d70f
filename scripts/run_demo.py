"""``make run``: the whole path on one machine, end to end.

Builds the tiny model, starts an engine server (vLLM on CPU/GPU, or the
simulated engine), a Dynamo bridge and a Dynamo frontend on loopback with file
discovery, sends sample rollouts through the frontend with the driver client,
prints the results and a summary (rollouts, p50 latency, tokens/s, time to the
first rollout), and stops everything on exit, Ctrl-C or SIGTERM. Waits show
their elapsed time as they go.

    python -m scripts.run_demo [--engine vllm|sim] [--model DIR] [--rollouts N] [--keep-logs]

``--model DIR``: your own model folder (HF layout: config.json, tokenizer.json,
tokenizer_config.json, weights), with or without a chat template; the default
is a tiny model built offline. The engine server runs with no flag beyond the
model and the rollout budget: what works here works for you as written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from harness import ROOT
from harness.env import dynamo_env, importable
from harness.http import served_models
from harness.procs import ProcessGroup
from harness.progress import counting, waiting
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until
from rl_client.driver import RolloutClient, RolloutResult

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
    return "vllm" if has_backend and importable("vllm") else "sim"


def engine_args(engine: str, model_dir: Path, name: str) -> list[str]:
    """The engine server's flags (after ``--backend ENGINE --listen ADDR``)."""
    args = ["--model", str(model_dir), "--served-model-name", name, "--max-new-tokens", "32"]
    if engine == "sim":
        args += ["--routed-experts", "2,2,8", "--eos-rate", "0.02"]
    return args


def stop_all(group: ProcessGroup) -> None:
    """Children in their own sessions (so Ctrl-C reaches only us), stopped in reverse."""
    for proc in reversed(group.procs):
        if proc.alive():
            say(f"stopping {proc.name} (pid {proc.pid})")
            proc.stop(timeout=20)
    group.close()


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


async def send_rollouts(
    base_url: str, model_dir: Path, name: str, count: int
) -> tuple[float, list[float], int, float]:
    """Sends them one after the other: (time to the first, each one's latency,
    tokens generated, seconds for all)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    first = 0.0
    latencies: list[float] = []
    tokens = 0
    began = time.monotonic()
    bar = counting("rollouts", count, unit="rollout")
    async with RolloutClient(base_url, name, timeout_s=120) as client:
        for i in range(count):
            prompt = PROMPTS[i % len(PROMPTS)]
            ids = tokenizer.encode(prompt).ids
            kwargs: dict[str, object] = {"greedy": i % 2 == 0, "max_tokens": 16 + 8 * (i % 3)}
            if i == 2:
                kwargs["stop_strings"] = ["."]
            started = time.monotonic()
            result = await client.rollout(ids, **kwargs)  # type: ignore[arg-type]
            latencies.append(time.monotonic() - started)
            tokens += len(result.token_ids)
            bar.update()
            with bar.external_write_mode():
                if i == 0:
                    first = time.monotonic() - T0
                    say(f"first rollout back: {first:.1f}s after start")
                show(i, prompt, result, tokenizer, latencies[-1])
    bar.close()
    return first, latencies, tokens, time.monotonic() - began


def run(engine: str, model: Path | None, rollouts: int, keep_logs: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="dynamo-demo-"))
    group = ProcessGroup(work / "logs")
    env = dynamo_env(work / "kv", DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="1")
    ok = False
    try:
        if model is None:
            say("[1/5] building the tiny model")
            model_dir, name = tiny_model_dir(), "tiny"
        else:
            say("[1/5] using your model folder")
            model_dir, name = model.resolve(), model.resolve().name
        say(f"      model at {model_dir}, served as {name!r}")

        say(f"[2/5] starting the engine server ({engine}); logs in {group.log_dir}")
        with waiting("      engine server starting (model load)"):
            _, address = group.engine_server(
                "engine",
                *engine_args(engine, model_dir, name),
                backend=engine,
                timeout=600 if engine == "vllm" else 60,
            )
        say(f"      listening on {address}")

        say("[3/5] starting the bridge (waits for the engine to be ready)")
        group.bridge("bridge", address, model_dir, name, NAMESPACE, env)

        _, base_url = group.frontend("frontend", env)
        say(f"[4/5] starting the Dynamo frontend on {base_url}")
        with waiting("      bridge and frontend starting, model registering"):
            wait_until(
                lambda: name in served_models(base_url),
                600 if engine == "vllm" else 120,
                f"model {name!r} at the frontend",
                group.procs,
            )
        say("      model registered")

        say(f"[5/5] sending {rollouts} rollouts")
        first, latencies, tokens, seconds = asyncio.run(
            send_rollouts(base_url, model_dir, name, rollouts)
        )
        print(
            f"\nSummary: {len(latencies)} rollouts, p50 latency "
            f"{statistics.median(latencies) * 1000:.0f} ms, {tokens} tokens in {seconds:.2f} s "
            f"({tokens / seconds:.0f} tokens/s, one at a time); first rollout "
            f"{first:.1f} s after start (engine: {engine})"
        )
        ok = True
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        if engine == "vllm":
            print("(try: python -m scripts.run_demo --engine sim)", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            stop_all(group)
        if ok and not keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {group.log_dir}")


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
