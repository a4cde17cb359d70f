"""``python -m engine_worker [--backend vllm|sim] <the dynamo.vllm command line>``

A drop-in for ``python -m dynamo.vllm`` as NeMo RL launches it: the same flags
and environment, served by an engine server and a bridge in two supervised
child processes (see the package docs, ``engine_worker.split`` for where each
argument goes and ``engine_worker.supervisor`` for restarts and signals).

Each side may run on its own Python (``--engine-python``/``--bridge-python``, or
``ENGINE_WORKER_ENGINE_PYTHON``/``ENGINE_WORKER_BRIDGE_PYTHON``): the engine's vLLM
and Dynamo then live in separate environments, each with this project installed.

Exit status: 0 after SIGTERM or SIGINT drained both children; 2 for a command
line refused at start (an argument neither side accepts, named) or a child
that refused its arguments on its first run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_worker.flags import MARKER, Arity, describe
from engine_worker.split import Split, UsageError, split_args
from engine_worker.supervisor import USAGE_ERROR, Backoff, Child, death_signal_setter

log = logging.getLogger("engine_worker")

# The parent-death watch of ``bridge.parent`` (a poll besides the kernel's signal).
BRIDGE_PARENT_ENV = "BRIDGE_PARENT_PID"
# Dynamo's settings are the bridge's business: the engine server never sees them.
ENGINE_ENV_DROPPED_PREFIXES = ("DYN_",)
# Files the bridge (and Dynamo's frontend) read from the model folder.
MODEL_FILE_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
# The longest unix socket path (sun_path, with its NUL).
_SUN_PATH_MAX = 107


def own_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine_worker",
        description=(
            "Run a Dynamo worker as two processes: an engine server (python -m "
            "engine_server) and a bridge (python -m bridge), from the command line "
            "NeMo RL builds for `python -m dynamo.vllm`. Every other argument goes to "
            "the side that accepts it: vLLM's engine arguments to the engine server, "
            "Dynamo's worker arguments to the bridge, --served-model-name to both, "
            "--model to the engine server and, as --model-path, to the bridge. An "
            "argument neither accepts is refused (exit 2)."
        ),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--backend",
        default="vllm",
        help="the engine server's backend (default: %(default)s; sim: the simulated engine)",
    )
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=12.0,
        help="on SIGTERM/SIGINT, how long each child may take to drain before it is "
        "killed (default: %(default)s, within the 15 s NeMo RL gives a worker; the "
        "engine server's own --grace-period-s is 10 s)",
    )
    for side, what in (("engine", "vLLM"), ("bridge", "Dynamo")):
        env = f"ENGINE_WORKER_{side.upper()}_PYTHON"
        parser.add_argument(
            f"--{side}-python",
            default=os.environ.get(env) or sys.executable,
            metavar="PATH",
            help=f"the Python that runs the {side} (it imports {what} and this project), "
            f"so that each side can have its own environment (default: ${env}, else this "
            "Python)",
        )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the two command lines (JSON) and exit",
    )
    return parser


def _own_flags(parser: argparse.ArgumentParser) -> dict[str, Arity]:
    return {**describe(parser), "-h": 0, "--help": 0}


@dataclass(frozen=True)
class Plan:
    """What the launcher runs."""

    engine_argv: list[str]
    engine_env: dict[str, str]
    bridge_argv: list[str]
    bridge_env: dict[str, str]
    private_dir: Path


def engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(ENGINE_ENV_DROPPED_PREFIXES)}


def bridge_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {**environ, BRIDGE_PARENT_ENV: str(os.getpid())}


def known_flags(
    python: str, side: str, backend: str | None, env: Mapping[str, str]
) -> dict[str, Arity]:
    """The flags one side's own parser knows, asked of it in a child process."""
    argv = [python, "-m", "engine_worker.flags", side, *([backend] if backend else [])]
    what = "the bridge's flags"
    if side == "engine":
        what = f"the engine server's flags (backend {backend})"
    try:
        out = subprocess.run(
            argv,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            preexec_fn=death_signal_setter(),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"listing {what} failed: {e}") from None
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(MARKER):
            listing: dict[str, Arity] = json.loads(line[len(MARKER) :])
            return listing
    raise UsageError(f"listing {what} failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")


def both_known_flags(
    pre: argparse.Namespace, e_env: Mapping[str, str], b_env: Mapping[str, str]
) -> tuple[dict[str, Arity], dict[str, Arity]]:
    """Both listings, asked at the same time (the engine's imports vLLM: seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        engine = pool.submit(known_flags, pre.engine_python, "engine", pre.backend, e_env)
        bridge = pool.submit(known_flags, pre.bridge_python, "bridge", None, b_env)
        return engine.result(), bridge.result()


def local_model_dir(model: str) -> str:
    """The folder the bridge reads the model's config and tokenizer from: ``model``
    itself, or, for a Hugging Face Hub name, those files of it (from the cache, or
    fetched as ``dynamo.vllm`` would; HF_HUB_OFFLINE is respected)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return os.fspath(path.resolve())
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, allow_patterns=MODEL_FILE_PATTERNS))
    except Exception as e:  # any failure means: no model folder
        raise UsageError(
            f"--model {model}: not a folder, and its config and tokenizer could not be "
            f"had from the Hugging Face Hub ({type(e).__name__}: {e})"
        ) from None


def _private_dir() -> Path:
    """A 0700 folder for the engine server's socket (short enough for sun_path)."""
    folder = Path(tempfile.mkdtemp(prefix="engine-worker-"))
    if len(os.fspath(folder / "engine.sock")) > _SUN_PATH_MAX:
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="engine-worker-", dir="/tmp"))
    return folder


def plan(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[argparse.Namespace, Plan]:
    """Parse and split ``argv``; raises UsageError for a command line refused."""
    parser = own_parser()
    pre, _ = parser.parse_known_args(argv)
    e_env, b_env = engine_env(environ), bridge_env(environ)
    engine_flags, bridge_flags = both_known_flags(pre, e_env, b_env)
    split: Split = split_args(
        argv,
        engine_flags,
        bridge_flags,
        own=_own_flags(parser),
        engine_name=f"the engine server (backend {pre.backend})",
    )
    if "-h" in split.own or "--help" in split.own:
        parser.print_help()
        raise SystemExit(0)
    args = parser.parse_args(split.own)
    if split.model is None:
        raise UsageError("--model is required (a model folder or a Hugging Face Hub name)")
    model_dir = local_model_dir(split.model)
    private = _private_dir()
    address = f"unix:{private / 'engine.sock'}"
    engine_argv = [args.engine_python, "-m", "engine_server"]
    engine_argv += ["--backend", args.backend, "--listen", address]
    bridge_argv = [args.bridge_python, "-m", "bridge", "--engine", address]
    bridge_argv += ["--model-path", model_dir]
    return args, Plan(
        engine_argv=[*engine_argv, *split.engine],
        engine_env=e_env,
        bridge_argv=[*bridge_argv, *split.bridge],
        bridge_env=b_env,
        private_dir=private,
    )


async def supervise(p: Plan, stop_timeout_s: float, backoff: Backoff | None = None) -> int:
    """Run both children until SIGTERM/SIGINT (0) or a fatal refusal (2)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    code = 0

    def fatal(exit_code: int) -> None:
        nonlocal code
        code = exit_code
        stop.set()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("received %s: draining the bridge and the engine server", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    backoff = backoff or Backoff()
    engine = Child("engine-server", p.engine_argv, p.engine_env, backoff, fatal)
    bridge = Child("bridge", p.bridge_argv, p.bridge_env, backoff, fatal)
    engine.start()
    bridge.start()
    try:
        await stop.wait()
    finally:
        bridge.terminate()  # first: the worker leaves discovery at once
        engine.terminate()
        await asyncio.gather(bridge.stop(stop_timeout_s), engine.stop(stop_timeout_s))
    return code


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("ENGINE_WORKER_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, p = plan(argv, os.environ)
    except UsageError as e:
        print(f"python -m engine_worker: error: {e}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    try:
        if args.dry_run:
            print(json.dumps({"engine_server": p.engine_argv, "bridge": p.bridge_argv}))
            raise SystemExit(0)
        log.info("engine server: %s", " ".join(p.engine_argv))
        log.info("bridge: %s", " ".join(p.bridge_argv))
        code = asyncio.run(supervise(p, args.stop_timeout_s))
    finally:
        shutil.rmtree(p.private_dir, ignore_errors=True)
    raise SystemExit(code)
