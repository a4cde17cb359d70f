"""The engine side's flag listing child, kept to become the engine server
(``engine_worker.listing``): it serves what it is handed, and one never handed
over is not left behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_worker.listing import engine_flags_kept
from harness import ROOT


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.fspath(ROOT)}


async def test_the_listing_child_runs_the_engine_server_on_what_it_is_handed() -> None:
    flags, listed = await engine_flags_kept(sys.executable, "sim", env())
    try:
        assert "--decode-step-ms" in flags and "--listen" in flags
        assert listed.process.returncode is None  # waiting for its arguments
        assert await listed.hand_over(["--backend", "sim", "--help"])
        assert listed.process.stdout is not None
        out = await asyncio.wait_for(listed.process.stdout.read(), 60)
        assert await listed.process.wait() == 0
        assert b"usage: python -m engine_server" in out
    finally:
        await listed.discard()


async def test_a_child_gone_before_the_hand_over_is_reported_not_handed() -> None:
    _, listed = await engine_flags_kept(sys.executable, "sim", env())
    listed.process.kill()
    await listed.process.wait()
    assert not await listed.hand_over(["--backend", "sim"])
    assert not listed.handed


async def test_end_of_input_instead_of_arguments_exits_0() -> None:
    _, listed = await engine_flags_kept(sys.executable, "sim", env())
    assert listed.process.stdin is not None
    listed.process.stdin.close()
    assert await asyncio.wait_for(listed.process.wait(), 30) == 0


def listing_children(tag: str) -> list[int]:
    """Live flag-listing processes started with ``LISTING_TEST_TAG=tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        tagged = f"LISTING_TEST_TAG={tag}".encode() in environ
        if tagged and b"engine_worker.flags" in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    ("extra", "code"), [(["--dry-run"], 0), (["--no-such-flag"], 2), (["--help"], 0)]
)
def test_a_launch_that_serves_nothing_leaves_no_listing_child(
    tmp_path: Path, extra: list[str], code: int
) -> None:
    tag = tmp_path.name
    argv = [sys.executable, "-m", "engine_worker", "--backend", "sim"]
    argv += ["--model", os.fspath(tmp_path), *extra]
    done = subprocess.run(
        argv, env={**env(), "LISTING_TEST_TAG": tag}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr[-2000:]
    # Gone as the launcher exits: it waits for the child it kills.
    assert not listing_children(tag)
