"""``python -m engine_worker``: the command line NeMo RL builds for ``python -m
dynamo.vllm``, run as an engine server and a bridge, two supervised children.

With file discovery instead of etcd (and ZMQ events instead of NATS), a Dynamo
frontend in front: the worker registers, serves rollouts, gets each child back
alone after a SIGKILL, refuses an argument no side knows, and drains on SIGTERM
(at any point of its start, the bridge before the engine server, NeMo RL's
SIGTERM of the whole process group included), leaving no socket folder behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import ROOT
from harness.engine import tiny_vllm_args
from harness.env import importable
from harness.http import wait_for_model
from harness.nemo_rl import GLOO, start_worker, worker_argv
from harness.procs import Proc, ProcessGroup, worker_children
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until
from rl_client import driver

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]


def wait_children(worker: Proc, timeout: float = 60.0, **unlike: int) -> dict[str, int]:
    """Until both children run, each named in ``unlike`` with another pid."""
    return wait_until(
        lambda: (
            (kids := worker_children(worker.pid)).keys() == {"engine-server", "bridge"}
            and all(kids[k.replace("_", "-")] != pid for k, pid in unlike.items())
            and kids
        ),
        timeout,
        f"the children of {worker.name}",
        [worker],
    )


async def rollouts(base_url: str, model: str, count: int = 3, timeout: float = 60.0) -> None:
    """``count`` rollouts through the frontend, retried until they all succeed."""
    retry = driver.RetryPolicy(attempts=8, initial_s=0.25, max_s=2.0)
    async with driver.RolloutClient(base_url, model, timeout_s=timeout, retry=retry) as client:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(client.rollout([5 + i, 17, 42, 99], max_tokens=8) for i in range(count))
            ),
            timeout,
        )
    for result in results:
        assert 0 < len(result.token_ids) <= 8
        assert len(result.logprobs) == len(result.token_ids)


def serving(stack: Stack, worker: Proc, model: str, timeout: float) -> None:
    wait_until(lambda: stack.registered_workers() >= 1, timeout, "the worker registered", [worker])
    wait_for_model(stack.base_url, model, [worker, *stack.procs], timeout)


async def start_serving(
    root: Path,
    group: ProcessGroup,
    base_model: Path,
    model: str,
    transfer: str,
    *args: str,
    timeout: float,
) -> tuple[Stack, Proc]:
    """A frontend, and behind it the worker from NeMo RL's command line for ``model``
    (``transfer`` its weight-transfer config, ``args`` after it), until it serves
    (``timeout`` seconds at the most)."""
    stack = Stack.new(root, group, base_model, model)
    stack.start_frontend()
    argv = worker_argv(base_model, model, stack.namespace, transfer)
    worker = start_worker(stack, "worker", *argv, *args).proc
    await asyncio.to_thread(serving, stack, worker, model, timeout)
    return stack, worker


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def assert_gone(pids: dict[str, int]) -> None:
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), pid


def private_folder(worker: Proc) -> Path:
    """The worker's socket folder, from the engine server's command line it logs."""
    match = re.search(r"unix:(\S+)/engine\.sock", worker.log_tail(100_000))
    assert match is not None, worker.log_tail()
    return Path(match.group(1))


def line_at(log: str, *parts: str) -> int:
    """Where the first line holding all ``parts`` starts in ``log``."""
    at = 0
    for line in log.splitlines(keepends=True):
        if all(part in line for part in parts):
            return at
        at += len(line)
    raise AssertionError(f"no line with {parts} in:\n{log[-4000:]}")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.fixture
def base_model() -> Path:
    """The template-less tiny model (a base checkpoint, as RL starts from)."""
    return tiny_model_dir("base")


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    with ProcessGroup(tmp_path / "logs") as g:
        yield g


def test_the_launcher_imports_neither_side() -> None:
    code = (
        "import sys, engine_worker.cli, engine_worker.__main__, engine_worker.split;"
        "print(sorted(m for m in ('vllm', 'torch', 'dynamo', 'bridge', 'engine_server', "
        "'grpc') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_an_argument_no_side_knows_is_refused_naming_it(base_model: Path) -> None:
    argv = [
        *worker_argv(base_model, "m", "ns", ""),
        "--disaggregation-mode",
        "prefill",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "engine_worker", "--backend", "sim", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "unrecognized argument --disaggregation-mode" in out.stderr
    # The dry run shows where each argument goes.
    out = subprocess.run(
        [sys.executable, "-m", "engine_worker", "--backend", "sim", "--dry-run", *argv[:-2]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    engine, bridge = plan["engine_server"], plan["bridge"]
    assert engine[engine.index("--seed") + 1] == "7" and "--namespace" not in engine
    assert bridge[bridge.index("--model-path") + 1] == str(base_model.resolve())
    assert "--enable-rl" in bridge and "--seed" not in bridge and "--model" not in bridge
    assert engine[engine.index("--served-model-name") + 1] == "m"
    assert bridge[bridge.index("--served-model-name") + 1] == "m"


async def test_sim_worker_serves_restarts_each_child_alone_and_drains(
    tmp_path: Path, group: ProcessGroup, base_model: Path
) -> None:
    model = "tiny-worker"
    sim = ("--backend", "sim", "--decode-step-ms", "1", "--stop-timeout-s", "20")
    stack, worker = await start_serving(tmp_path, group, base_model, model, "", *sim, timeout=90)
    await rollouts(stack.base_url, model)
    first = worker_children(worker.pid)
    assert first.keys() == {"engine-server", "bridge"}
    # The first engine server is the child that listed its flags, handed over
    # (engine_worker.listing): its imports are not done twice.
    assert cmdline(first["engine-server"])[2:] == [
        "engine_worker.flags",
        "engine",
        "sim",
        "--serve",
    ]

    # The bridge dies: it alone comes back, and rollouts resume.
    os.kill(first["bridge"], signal.SIGKILL)
    second = await asyncio.to_thread(wait_children, worker, 30, bridge=first["bridge"])
    assert second["engine-server"] == first["engine-server"]
    await rollouts(stack.base_url, model)

    # The engine server dies: it alone comes back; the bridge reconnects.
    os.kill(first["engine-server"], signal.SIGKILL)
    third = await asyncio.to_thread(wait_children, worker, 30, engine_server=first["engine-server"])
    assert third["bridge"] == second["bridge"]
    assert cmdline(third["engine-server"])[1:3] == ["-m", "engine_server"]  # a restart
    await rollouts(stack.base_url, model)
    assert worker_children(worker.pid) == third
    log = worker.log_tail(200_000)  # the output passes through, each line prefixed
    assert f"[bridge {second['bridge']}] " in log
    assert f"[engine-server {third['engine-server']}] " in log

    # SIGTERM drains both and exits 0.
    worker.signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.wait_exit, 40) == 0
    assert_gone(third)
    await asyncio.to_thread(
        wait_until, lambda: stack.registered_workers() == 0, 15, "the worker unregistered"
    )


def registered_sim_worker(
    tmp_path: Path, group: ProcessGroup, base_model: Path, model: str, namespace: str
) -> tuple[Proc, dict[str, int]]:
    """A sim worker from NeMo RL's command line, its children up and it registered."""
    stack = Stack.new(tmp_path, group, base_model, model, namespace)
    argv = worker_argv(base_model, model, stack.namespace, "")
    worker = start_worker(stack, "worker", "--backend", "sim", *argv).proc
    kids = wait_children(worker)
    wait_until(lambda: stack.registered_workers() >= 1, 60, "the worker registered", [worker])
    return worker, kids


def test_the_children_end_with_a_killed_launcher(
    tmp_path: Path, group: ProcessGroup, base_model: Path
) -> None:
    worker, kids = registered_sim_worker(tmp_path, group, base_model, "tiny-orphan", "nsorphan")
    worker.kill()
    # The kernel's parent-death signal (SIGTERM): each child drains and exits.
    wait_until(lambda: all(_state(pid) in ("gone", "Z") for pid in kids.values()), 30, "orphans")
    # Its watcher removes the private folder (the socket's) all the same.
    folder = private_folder(worker)
    wait_until(lambda: not folder.exists(), 10, f"{folder} removed")


def test_a_sigterm_of_the_process_group_drains_the_bridge_first_then_exits_0(
    tmp_path: Path, group: ProcessGroup, base_model: Path
) -> None:
    worker, kids = registered_sim_worker(tmp_path, group, base_model, "tiny-order", "nsorder")
    folder = private_folder(worker)
    started = time.monotonic()
    os.killpg(worker.pid, signal.SIGTERM)  # NeMo RL's stop, 15 s before its SIGKILL
    assert worker.wait_exit(15) == 0
    assert time.monotonic() - started < 15
    assert_gone(kids)
    assert not folder.exists()
    # The engine server is signalled only once the bridge is gone.
    log = worker.log_tail(400_000)
    bridge_gone = line_at(log, f"bridge (pid {kids['bridge']}) stopped")
    engine_told = line_at(log, f"[engine-server {kids['engine-server']}] ", "received SIGTERM")
    assert bridge_gone < engine_told


def listing_worker(tmp_path: Path, group: ProcessGroup) -> tuple[Proc, Path]:
    """A launcher listing its engine's flags, with an engine Python that takes its
    time to answer (as vLLM's imports can); the file the listing's pid is in."""
    listing = tmp_path / "listing.pid"
    slow = tmp_path / "slow-python"
    slow.write_text(
        f"#!{sys.executable}\nimport os, time\n"
        f"open({os.fspath(listing)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    )
    slow.chmod(0o755)
    argv = [sys.executable, "-m", "engine_worker", "--backend", "sim"]
    argv += ["--engine-python", os.fspath(slow), "--model", os.fspath(tmp_path)]
    worker = group.spawn("worker", argv)
    wait_until(lambda: listing.exists() and listing.read_text(), 30, "the listing", [worker])
    return worker, listing


def test_a_sigterm_while_the_flags_are_listed_exits_0(tmp_path: Path, group: ProcessGroup) -> None:
    worker, listing = listing_worker(tmp_path, group)
    os.killpg(worker.pid, signal.SIGTERM)
    assert worker.wait_exit(15) == 0, worker.log_tail()
    wait_until(lambda: _state(int(listing.read_text())) in ("gone", "Z"), 5, "the listing ended")


def test_sigterm_repeated_until_it_exits_still_exits_0(tmp_path: Path, group: ProcessGroup) -> None:
    """A supervisor repeating SIGTERM up to the very end: the exit is still clean,
    never death by the signal once the launcher has stopped."""
    worker, _ = listing_worker(tmp_path, group)
    assert worker.signal_until_exit(signal.SIGTERM, 15) == 0, worker.log_tail()


@pytest.mark.vllm
@pytest.mark.skipif(not importable("vllm"), reason="vLLM not installed")
async def test_vllm_worker_from_the_nemo_rl_command_line(
    tmp_path: Path, group: ProcessGroup, base_model: Path
) -> None:
    model = "tiny-worker-vllm"
    stack, worker = await start_serving(
        tmp_path, group, base_model, model, GLOO, *tiny_vllm_args(512), timeout=300
    )
    await rollouts(stack.base_url, model, timeout=120)
    kids = worker_children(worker.pid)
    worker.signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.wait_exit, 60) == 0
    assert_gone(kids)
