"""engine_worker's start and stop: the socket folder (its path counted in bytes,
removed even after a SIGKILL), the children stopped bridge first, and an empty
``--model`` refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine_worker.cli import Plan, supervise
from harness import ROOT
from harness.waits import wait_until
from launch.private_dir import SUN_PATH_MAX, PrivateDir
from launch.supervisor import RestartPolicy

pytestmark = pytest.mark.serial

# A child that logs its SIGTERM to the file argv[1] and, for the bridge, drains
# (argv[3] seconds, or forever: "hang") before it exits.
CHILD = """
import signal, sys, time
log, name, drain = sys.argv[1], sys.argv[2], sys.argv[3]
def note(what):
    with open(log, "a") as f:
        f.write(f"{name}-{what}\\n")
def on_term(*_):
    note("term")
    if drain == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    time.sleep(float(drain))
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("ready")
while True:
    time.sleep(1)
"""


def test_the_socket_path_fits_in_bytes_under_a_non_ascii_tmpdir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 100 characters to the socket, but 2 bytes for each "é": over sun_path's limit.
    rest = len("/engine-server-12345678/engine.sock")
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # short: pytest's own tmp_path may not be
    try:
        base = top / ("é" * (100 - rest - len(os.fspath(top)) - 1))
        base.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", os.fspath(base))
        assert len(os.fspath(base)) + rest == 100
        assert len(os.fsencode(base)) + rest > SUN_PATH_MAX
        private = PrivateDir()
        try:
            assert len(os.fsencode(private.socket)) <= SUN_PATH_MAX
            assert private.path.stat().st_mode & 0o777 == 0o700
        finally:
            private.remove()
        assert not private.path.exists()
    finally:
        shutil.rmtree(top)


# The owner of a PrivateDir, killed outright: alone, or with a child it forked without
# exec (as a fork-started multiprocessing worker is) that holds the watcher's pipe too.
OWNERS = {
    "alone": "",
    "with a forked child": "if os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n",
}


@pytest.mark.parametrize("forks", OWNERS.values(), ids=list(OWNERS))
def test_the_socket_folder_goes_with_a_sigkilled_owner(forks: str) -> None:
    code = (
        "import os, time\nfrom launch.private_dir import PrivateDir\np = PrivateDir()\n"
        f"{forks}print(p.path, flush=True)\ntime.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group: the owner and any child it forked
    )
    try:
        assert owner.stdout is not None
        folder = Path(owner.stdout.readline().strip())
        assert folder.is_dir()
        owner.kill()
        owner.wait(10)
        wait_until(lambda: not folder.exists(), 10, "the socket folder removed")
        if forks:
            os.killpg(owner.pid, 0)  # the pipe's other holder lived on meanwhile
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)


def test_remove_ends_the_watcher_though_a_forked_child_holds_its_pipe() -> None:
    private = PrivateDir()
    watcher = private._watcher
    assert watcher is not None
    child = os.fork()
    if child == 0:  # holds the pipe's write end, as a fork-started worker would
        time.sleep(30)
        os._exit(0)
    try:
        private.remove()
        assert not private.path.exists() and watcher.poll() is not None
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _plan(tmp_path: Path, bridge_drain: str) -> tuple[Plan, Path]:
    log = tmp_path / "events"
    log.touch()
    private = PrivateDir()

    def argv(name: str, drain: str) -> list[str]:
        return [sys.executable, "-c", CHILD, os.fspath(log), name, drain]

    env = dict(os.environ)
    plan = Plan(argv("engine", "0"), env, argv("bridge", bridge_drain), env, private)
    return plan, log


def _events(log: Path) -> list[str]:
    return log.read_text().split()


async def _run_and_stop(
    tmp_path: Path, bridge_drain: str, stop_timeout_s: float
) -> tuple[list[str], float]:
    """Supervise a plan (the bridge draining for ``bridge_drain``) until both
    children are up, then stop: the events, and the seconds the stop took. The
    plan's private folder is removed however the run ends."""
    plan, log = _plan(tmp_path, bridge_drain)
    try:
        stop = asyncio.Event()
        task = asyncio.create_task(supervise(plan, stop_timeout_s, stop, RestartPolicy()))
        deadline = time.monotonic() + 20
        while {"engine-ready", "bridge-ready"} - set(_events(log)):
            assert time.monotonic() < deadline and not task.done(), _events(log)
            await asyncio.sleep(0.05)
        started = time.monotonic()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        return _events(log)[2:], time.monotonic() - started
    finally:
        plan.private.remove()


async def test_the_bridge_drains_before_the_engine_server_is_signalled(tmp_path: Path) -> None:
    events, _ = await _run_and_stop(tmp_path, "1", 10)
    assert events == ["bridge-term", "bridge-exit", "engine-term", "engine-exit"]


async def test_a_hung_bridge_still_leaves_the_engine_server_its_drain(tmp_path: Path) -> None:
    events, took = await _run_and_stop(tmp_path, "hang", 1)
    # The bridge killed at the budget's end, then the engine server stopped in turn.
    assert events == ["bridge-term", "engine-term", "engine-exit"]
    assert 1 <= took < 8


def test_an_empty_model_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    for empty in (["--model="], ["--model", ""]):
        out = subprocess.run(
            [sys.executable, "-m", "engine_worker", "--backend", "sim", "--dry-run", *empty],
            cwd=tmp_path,  # the folder an empty --model would have meant
            env={**os.environ, "PYTHONPATH": os.fspath(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert "--model is empty" in out.stderr
        assert os.fspath(tmp_path) not in out.stdout
