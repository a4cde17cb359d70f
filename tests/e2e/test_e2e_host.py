"""Host embedding: a generation worker puts its own engine behind Dynamo in one call.

The worker (``host_worker.py``) owns its engine on its loop, its root log
handler and its SIGTERM handler; it calls ``start_dynamo_endpoint`` once. The
frontend is real, the bridge a real child process of the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.engine import prompt_of
from harness.env import importable
from harness.http import served_models
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver

pytestmark = pytest.mark.dynamo

HOST = "tests.e2e.host_worker"


@dataclass
class Host:
    stack: Stack
    proc: Proc
    status_path: Path
    name: str

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}


def start_host(
    stack: Stack, name: str, engine: str, *, worker_idx: int = 0, timeout: float = 60
) -> Host:
    status = stack.root / f"{name}.json"
    argv = [
        sys.executable,
        "-m",
        HOST,
        "--engine",
        engine,
        "--model",
        str(stack.model_dir),
        "--name",
        name,
        "--namespace",
        stack.namespace,
        "--status",
        str(status),
        "--engine-env",
        json.dumps(stack.env),
        "--worker-idx",
        str(worker_idx),
    ]
    proc = stack.group.spawn(f"host-{name}", argv, stack.env)
    host = Host(stack, proc, status, name)
    wait_until(lambda: bool(host.status()), timeout, "host status", [proc])
    return host


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def rollout(stack: Stack, name: str, prompt: list[int]) -> driver.RolloutResult:
    # Patient: a killed bridge's instance stays in file discovery until its TTL,
    # so the frontend may pick it (503) until the restarted bridge is found.
    retry = driver.RetryPolicy(attempts=30, initial_s=0.25, max_s=1.0)
    async with driver.RolloutClient(stack.base_url, name, timeout_s=60, retry=retry) as client:
        return await client.rollout(prompt, greedy=True, max_tokens=16)


@pytest.fixture
def stack(tmp_path: Path, model_dir: Path) -> Iterator[Stack]:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "hosted")
        stack.start_frontend()
        yield stack


async def test_a_hosted_sim_engine_serves_and_survives_its_bridge_dying(stack: Stack) -> None:
    host = start_host(stack, "hosted", "sim")
    stack.wait_models(["hosted"], timeout=60)
    first = await rollout(stack, "hosted", [5, 6, 7, 8])
    assert len(first.token_ids) == 16
    # The bridge's log lines reach the host's own logging, its levels kept.
    log = host.proc.log_tail(200_000)
    assert "HOST INFO engine_server.host.bridge: [bridge" in log, log[-2000:]
    assert host.status()["root_handlers"] == ["StreamHandler"]
    # kill -9 the bridge: the worker restarts it and serves again.
    old = host.status()["bridge_pid"]
    os.kill(old, signal.SIGKILL)
    started = time.monotonic()
    wait_until(
        lambda: host.status().get("restarts", 0) >= 1 and alive(host.status().get("bridge_pid")),
        30,
        "bridge restarted",
        [host.proc],
    )
    wait_until(lambda: "hosted" in served_models(stack.base_url), 30, "model back", [host.proc])
    again = await rollout(stack, "hosted", [5, 6, 7, 8])
    assert again.token_ids == first.token_ids
    print(f"bridge restarted and serving {time.monotonic() - started:.1f}s after kill -9")
    assert "restart 1" in host.proc.log_tail(200_000)


async def test_sigterm_runs_the_hosts_handler_and_the_model_leaves(stack: Stack) -> None:
    host = start_host(stack, "hosted", "sim")
    stack.wait_models(["hosted"], timeout=60)
    bridge = host.status()["bridge_pid"]
    host.proc.signal(signal.SIGTERM)
    assert host.proc.wait_exit(30) == 0
    assert host.status_path.with_suffix(".sigterm").read_text() == "host handler ran\n"
    assert not alive(bridge)
    wait_until(lambda: "hosted" not in served_models(stack.base_url), 10, "model gone", [])


async def test_kill_9_of_the_host_takes_the_model_out_of_discovery(stack: Stack) -> None:
    """...and leaves no socket folder behind (the watcher removes it)."""
    host = start_host(stack, "hosted", "sim")
    stack.wait_models(["hosted"], timeout=60)
    bridge = host.status()["bridge_pid"]
    folder = Path(host.status()["address"].removeprefix("unix:")).parent
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700
    host.proc.kill()
    started = time.monotonic()
    wait_until(lambda: "hosted" not in served_models(stack.base_url), 10, "model gone", [])
    gone_s = time.monotonic() - started
    wait_until(lambda: not alive(bridge), 10, "bridge exited", [])
    wait_until(lambda: not folder.exists(), 10, "socket folder removed", [])
    print(f"model left discovery {gone_s:.1f}s after kill -9 of the host")


def test_only_the_leader_serves(stack: Stack) -> None:
    host = start_host(stack, "follower", "sim", worker_idx=1)
    status = host.status()
    assert status["serving"] is False and "not the leader" in status["reason"]
    assert status["bridge_pid"] is None


@pytest.mark.vllm
@pytest.mark.skipif(not importable("vllm"), reason="needs vLLM")
async def test_a_hosted_asyncllm_serves_exactly_what_it_generates_directly(stack: Stack) -> None:
    host = start_host(stack, "hosted", "vllm", timeout=240)
    stack.wait_models(["hosted"], timeout=120)
    prompts = [prompt_of(6 + s, seed=s) for s in range(5)]
    through = [await rollout(stack, "hosted", p) for p in prompts]
    host.status_path.with_suffix(".direct").write_text(
        json.dumps({"prompts": prompts, "max_tokens": 16})
    )
    answer = host.status_path.with_suffix(".answer")
    wait_until(answer.exists, 60, "direct answers", [host.proc])
    direct = json.loads(answer.read_text())
    for result, expected in zip(through, direct, strict=True):
        assert result.token_ids == expected["token_ids"]
        assert result.logprobs == expected["logprobs"]
