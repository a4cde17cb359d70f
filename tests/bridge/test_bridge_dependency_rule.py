"""The dependency rule, checked at runtime: the bridge runs where vllm and torch
cannot be imported; the engine server where dynamo and bridge cannot."""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT
from harness.env import blocking_env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_blocker_blocks() -> None:
    out = run(blocking_env("vllm", "torch"), "-c", "import torch")
    assert out.returncode != 0 and "blocked" in out.stderr


def test_bridge_imports_and_runs_without_vllm_or_torch() -> None:
    env = blocking_env("vllm", "torch")
    out = run(env, "-c", "import bridge.engine, bridge.__main__, bridge.driver; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    # The driver's batch output imports torch only when its caller asks for tensors.
    out = run(env, "-c", "import bridge.batch; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = run(env, "-m", "bridge", "--help")
    assert out.returncode == 0, out.stderr
    assert "--engine" in out.stdout and "--discovery-backend" in out.stdout


def test_engine_server_imports_no_dynamo_or_bridge() -> None:
    env = blocking_env("dynamo", "bridge")
    code = (
        "import engine_server.server, engine_server.cli, engine_server.servicer, "
        "engine_server.backends.sim; print('ok')"
    )
    out = run(env, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = run(env, "-m", "engine_server", "--backend", "sim", "--help")
    assert out.returncode == 0, out.stderr
