"""A lost engine server fails requests at once (no hang), and the bridge serves
again, KV view included, when an engine server comes back at the same address."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from procs import (
    ProcessGroup,
    blocking_env,
    dynamo_env,
    free_port,
    http_json,
    served_models,
    wait_for_model,
)
from procs import wait_until as wait

from bridge import driver

pytestmark = pytest.mark.dynamo

MODEL = "tiny-restart"


def rollout(base_url: str) -> tuple[int, object]:
    body = driver.build_rollout_body(MODEL, [5, 6, 7, 8], greedy=True, max_tokens=4)
    return http_json(f"{base_url}/v1/completions", body, timeout=30)


def test_engine_server_restart(tmp_path: Path, model_dir: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    engine_args = ("--model", str(model_dir), "--served-model-name", MODEL)
    env = dynamo_env(tmp_path / "kv")
    with ProcessGroup(tmp_path / "logs") as group:
        engine, address = group.engine_server("engine-1", *engine_args, listen=listen)
        bridge = group.bridge(
            "bridge",
            address,
            model_dir,
            MODEL,
            "restart",
            {**env, **blocking_env("vllm", "torch")},
            "--log-level",
            "debug",
        )
        frontend, base_url = group.frontend("frontend", env)
        wait_for_model(base_url, MODEL, [engine, bridge, frontend])
        status, body = rollout(base_url)
        assert status == 200, body
        first_instance = driver.parse_rollout_response(body).instance_id  # type: ignore[arg-type]

        engine.kill()
        started = time.monotonic()
        status, body = rollout(base_url)
        assert status >= 500, body
        assert time.monotonic() - started < 10

        engine2, _ = group.engine_server("engine-2", *engine_args, listen=listen)

        def serves_again() -> object:
            status, body = rollout(base_url)
            return body if status == 200 else None

        body = wait(serves_again, 30, "a rollout after the restart", [engine2, bridge, frontend])
        result = driver.parse_rollout_response(body)  # type: ignore[arg-type]
        assert result.instance_id != first_instance and len(result.token_ids) == 4
        wait(
            lambda: "instance changed" in bridge.log_tail(50_000),
            10,
            "the KV relay to follow the new engine instance",
            [bridge],
        )

        # SIGTERM: Dynamo unregisters the worker, calls cleanup(), and the bridge exits.
        bridge.signal(signal.SIGTERM)
        assert bridge.popen.wait(30) == 0
        assert "bridge cleaned up" in bridge.log_tail(20_000)
        wait(lambda: MODEL not in served_models(base_url), 10, "the model to go", [frontend])


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
            "--connect-timeout",
            "1",
        )
        assert bridge.popen.wait(60) == 1
        assert "not ready after 1s" in bridge.log_tail()
