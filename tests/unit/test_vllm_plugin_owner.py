"""engine_server.vllm_plugin.end_with_engine_server, decided at a vLLM process's
start: a process whose engine server is already dead (an actor killed while
vLLM was starting) ends at once; one under a live engine server that is not its
parent (a grandchild) keeps running. Real processes, no vLLM needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from engine_server.vllm_plugin import OWNER_ENV

# The plugin runs, then the process lives on for a moment unless it was ended.
PROGRAM = (
    "import time; from engine_server.vllm_plugin import end_with_engine_server; "
    "end_with_engine_server(); time.sleep(0.5); print('still running')"
)


def run_with_owner(owner: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, OWNER_ENV: str(owner)}
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )


def a_dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_process_whose_engine_server_is_already_dead_ends_at_once() -> None:
    result = run_with_owner(a_dead_pid())
    assert result.returncode == -signal.SIGKILL, result
    assert "still running" not in result.stdout
    assert "was gone before this vLLM process started" in result.stderr


def test_a_process_under_a_live_engine_server_that_is_not_its_parent_runs_on() -> None:
    # The "engine server": a live process that is not the child's parent.
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as owner:
        try:
            result = run_with_owner(owner.pid)
        finally:
            owner.kill()
    assert result.returncode == 0, result
    assert "still running" in result.stdout
