"""A bridge started without an engine server gives up with a clear message.

The engine-server restart itself (requests in flight failing at once, /health,
reconnection, the KV view) is tests/faults/test_faults_engine_death.py; SIGTERM
on the bridge is tests/faults/test_faults_sigterm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.env import blocking_env, dynamo_env
from harness.ports import free_port
from harness.procs import ProcessGroup

pytestmark = pytest.mark.dynamo

MODEL = "tiny-restart"


def test_bridge_without_an_engine_server_exits_with_a_clear_message(
    tmp_path: Path, model_dir: Path
) -> None:
    env = dynamo_env(tmp_path / "kv")
    with ProcessGroup(tmp_path / "logs") as group:
        bridge = group.bridge(
            "bridge",
            f"127.0.0.1:{free_port()}",
            model_dir,
            MODEL,
            "nobody",
            {**env, **blocking_env("vllm", "torch")},
            "--connect-timeout-s",
            "1",
        )
        assert bridge.popen.wait(60) == 1
        assert "not ready after 1s" in bridge.log_tail()
