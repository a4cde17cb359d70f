"""``python -m engine_worker [--backend vllm|sim] <the dynamo.vllm command line>``

A drop-in for ``python -m dynamo.vllm`` as NeMo RL launches it: the same flags
and environment, served by an engine server and a bridge in two supervised
child processes (see the package docs, ``engine_worker.split`` for where each
argument goes and ``launch.supervisor`` for restarts and signals).

Each side may run on its own Python (``--engine-python``/``--bridge-python``, or
``ENGINE_WORKER_ENGINE_PYTHON``/``ENGINE_WORKER_BRIDGE_PYTHON``): the engine's vLLM
and Dynamo then live in separate environments, each with this project installed.

Exit status: 0 after SIGTERM or SIGINT, at any point (start-up included: the
flag listings and the model folder are given up, their children killed); 2 for
a command line refused at start (an argument neither side accepts, named) or a
child that refused its arguments on its first run; 1 for a child that could not
be started at all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from engine_worker.flags import Arity, describe
from engine_worker.listing import Listed, both_known_flags, write_early
from engine_worker.split import Split, UsageError, split_args
from launch.bridge_command import BridgeLaunch, bridge_argv
from launch.leases import LeasesFile
from launch.parent_death import with_parent_pid
from launch.private_dir import PrivateDir
from launch.stop_signals import stop_signals
from launch.supervisor import (
    USAGE_ERROR,
    ChildProcess,
    PassThrough,
    RestartPolicy,
    stop_in_order,
)

T = TypeVar("T")

log = logging.getLogger("engine_worker")

# Dynamo's settings are the bridge's business: the engine server never sees them.
ENGINE_ENV_DROPPED_PREFIXES = ("DYN_",)
# Files the bridge (and Dynamo's frontend) read from the model folder.
MODEL_FILE_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
# On a stop, the engine server's least time to drain, even after a bridge that
# used the whole --stop-timeout-s (12 + 2 s: inside NeMo RL's 15).
ENGINE_STOP_FLOOR_S = 2.0


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
        help="on SIGTERM/SIGINT, how long the two children may take to drain, the "
        "bridge first and then the engine server, before each is killed (default: "
        f"%(default)s, within the 15 s NeMo RL gives a worker; the engine server gets "
        f"at least {ENGINE_STOP_FLOOR_S:.0f} s of its own)",
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
    private: PrivateDir
    # The child that listed the engine's flags, waiting to serve engine_argv
    # (None: the supervisor starts the engine server).
    engine_listed: Listed | None = None

    @property
    def leases(self) -> LeasesFile:
        """Where the bridge notes its etcd leases, revoked when it exits."""
        return LeasesFile(self.private.path)

    def bridge_environment(self) -> dict[str, str]:
        """The bridge's environment, the file for its leases named."""
        return {**self.bridge_env, **self.leases.env()}


def engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(ENGINE_ENV_DROPPED_PREFIXES)}


def bridge_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The bridge also watches for the launcher gone itself (a poll besides the
    kernel's signal)."""
    return with_parent_pid(environ)


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


async def _in_daemon_thread(work: Callable[[], T]) -> T:
    """``work()`` off the loop, in a daemon thread: unlike asyncio's executor, one
    that neither the loop's end nor the interpreter's waits for, so that a stop in
    the middle of a download ends the worker at once."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # given up
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(cast(T, result))

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = work()
        except BaseException as e:  # handed to the awaiting task as is
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="engine-worker-model", daemon=True).start()
    return await done


async def plan(
    parser: argparse.ArgumentParser,
    pre: argparse.Namespace,
    argv: Sequence[str],
    environ: Mapping[str, str],
) -> tuple[argparse.Namespace, Plan] | None:
    """Split ``argv`` (``pre``: the launcher's own flags, parsed by ``parser``; None:
    the help was asked for, and printed); raises UsageError for a command line
    refused."""
    e_env, b_env = engine_env(environ), bridge_env(environ)
    engine_flags, listed, bridge_flags = await both_known_flags(
        pre.engine_python, pre.backend, pre.bridge_python, e_env, b_env
    )
    try:
        split: Split = split_args(
            argv,
            engine_flags,
            bridge_flags,
            own=_own_flags(parser),
            engine_name=f"the engine server (backend {pre.backend})",
        )
        if "-h" in split.own or "--help" in split.own:
            parser.print_help()
            await listed.discard()
            return None
        args = parser.parse_args(split.own)
        model = split.model
        if model is None:
            raise UsageError("--model is required (a model folder or a Hugging Face Hub name)")
        model_dir = await _in_daemon_thread(lambda: local_model_dir(model))
        # Last, with no wait after it: a stop cannot leave it behind unrecorded.
        private = PrivateDir()
    except BaseException:  # refused, or the worker is stopping
        await listed.discard()
        raise
    address = private.address
    engine_argv = [args.engine_python, "-m", "engine_server"]
    engine_argv += ["--backend", args.backend, "--listen", address]
    launch = BridgeLaunch(engine_address=address, model_path=model_dir)
    return args, Plan(
        engine_argv=[*engine_argv, *split.engine],
        engine_env=e_env,
        bridge_argv=bridge_argv(args.bridge_python, launch, split.bridge),
        bridge_env=b_env,
        private=private,
        engine_listed=listed,
    )


async def engine_first_run(p: Plan) -> asyncio.subprocess.Process | None:
    """The listing child (``--engine-python``'s, with the engine's environment),
    handed the engine server's arguments; None when it died before: the
    supervisor starts one."""
    listed = p.engine_listed
    if listed is None:
        return None
    if not await listed.hand_over(p.engine_argv[3:]):  # after "python -m engine_server"
        log.warning("the engine's flag listing child ended: starting the engine server anew")
        return None
    write_early(listed, f"[engine-server {listed.process.pid}] ")
    return listed.process


async def supervise(
    p: Plan, stop_timeout_s: float, stop: asyncio.Event, restart: RestartPolicy | None = None
) -> int:
    """Run both children until ``stop`` (0) or one that restarting cannot help (2:
    it refused its arguments; 1: it cannot be started); then stop the bridge first
    (it leaves discovery and ends its requests, which need the engine server),
    then the engine server."""
    if stop.is_set():
        return 0
    code = 0

    def fatal(exit_code: int) -> None:
        nonlocal code
        code = exit_code
        stop.set()

    def child(
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        first: asyncio.subprocess.Process | None = None,
        after_exit: Callable[[int], Awaitable[None]] | None = None,
    ) -> ChildProcess:
        return ChildProcess(
            name,
            argv,
            env,
            output=PassThrough(),
            restart=restart,
            arm_death_signal=True,  # no other thread runs by now (the download is done)
            on_fatal=fatal,
            logger=log,
            first=first,
            after_exit=after_exit,
        )

    first = await engine_first_run(p)
    engine = child("engine-server", p.engine_argv, p.engine_env, first)
    # A bridge that died leaves its records in etcd no longer than that.
    bridge = child("bridge", p.bridge_argv, p.bridge_environment(), after_exit=p.leases.revoke)
    engine.start()
    bridge.start()
    try:
        await stop.wait()
    finally:
        await stop_in_order([bridge, engine], stop_timeout_s, ENGINE_STOP_FLOOR_S)
    return code


async def _unless_stopped(stop: asyncio.Event, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once ``stop`` is set first (``work`` cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its children killed
    return None if task.cancelled() else task.result()


async def run(
    parser: argparse.ArgumentParser,
    pre: argparse.Namespace,
    argv: Sequence[str],
    environ: Mapping[str, str],
) -> int:
    """The worker, start-up included, under one stop event: a SIGTERM or SIGINT at
    any point ends it with 0, stopping what it has started."""
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("received %s: stopping", sig.name)
        stop.set()

    # Ignored once stopped (launch.stop_signals).
    with stop_signals(asyncio.get_running_loop(), on_signal):
        try:
            planned = await _unless_stopped(stop, plan(parser, pre, argv, environ))
        except UsageError as e:
            if stop.is_set():
                return 0
            print(f"python -m engine_worker: error: {e}", file=sys.stderr)
            return USAGE_ERROR
        if planned is None:  # stopped during start-up, or the help shown
            return 0
        args, p = planned
        try:
            if args.dry_run:
                print(json.dumps({"engine_server": p.engine_argv, "bridge": p.bridge_argv}))
                return 0
            log.info("engine server: %s", " ".join(p.engine_argv))
            log.info("bridge: %s", " ".join(p.bridge_argv))
            return await supervise(p, args.stop_timeout_s, stop)
        finally:
            if p.engine_listed is not None:
                await p.engine_listed.discard()  # unless handed over
            p.private.remove()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("ENGINE_WORKER_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = own_parser()
    # Here, not in a task: argparse's own exits (an error, -h) end the program as is.
    pre, _ = parser.parse_known_args(argv)
    raise SystemExit(asyncio.run(run(parser, pre, argv, os.environ)))
