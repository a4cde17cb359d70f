"""CLI -> configs (Dynamo's flags and env vars), and logging that survives Dynamo."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dynamo.runtime.logging import configure_dynamo_logging

from bridge.config import MODEL_FILES, parse_args
from bridge.logging import LOGGER_NAME, SKIP_SGLANG_LOGGING_ENV, configure_bridge_logging
from harness.env import ONE_MACHINE_FLAGS


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    for name in MODEL_FILES:
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_cli_maps_to_bridge_and_worker_config(model_dir: Path) -> None:
    bridge, worker = parse_args(
        [
            "--engine",
            "127.0.0.1:5",
            "--model-path",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--namespace",
            "ns",
            *ONE_MACHINE_FLAGS,  # file, tcp, zmq
            "--connect-timeout-s",
            "7",
            "--max-message-bytes",
            str(8 * 1024 * 1024),
            "--log-level",
            "debug",
        ]
    )
    assert bridge.engine_address == "127.0.0.1:5" and bridge.connect_timeout_s == 7
    assert bridge.client.max_message_bytes == 8 * 1024 * 1024 and bridge.log_level == "DEBUG"
    assert (worker.namespace, worker.component, worker.endpoint) == ("ns", "backend", "generate")
    assert (worker.discovery_backend, worker.request_plane, worker.event_plane) == (
        "file",
        "tcp",
        "zmq",
    )
    assert worker.model_name == str(model_dir) and worker.served_model_name == "tiny"
    assert worker.enable_kv_routing
    assert bridge.client.paced_generates  # the default


def test_dynamo_environment_variables_honoured(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "file")
    monkeypatch.setenv("DYN_REQUEST_PLANE", "tcp")
    monkeypatch.setenv("DYN_EVENT_PLANE", "zmq")
    monkeypatch.setenv("DYN_NAMESPACE", "envns")
    monkeypatch.setenv("BRIDGE_ENGINE_ADDRESS", "unix:/tmp/x.sock")
    monkeypatch.setenv("BRIDGE_GENERATE_PACING", "off")
    bridge, worker = parse_args(
        ["--model-path", str(model_dir), "--disable-kv-events", "--endpoint", "dyn://a.b.c"]
    )
    assert bridge.engine_address == "unix:/tmp/x.sock" and not bridge.kv_events
    assert not bridge.client.paced_generates
    assert (worker.discovery_backend, worker.request_plane, worker.event_plane) == (
        "file",
        "tcp",
        "zmq",
    )
    assert (worker.namespace, worker.component, worker.endpoint) == ("a", "b", "c")
    assert not worker.enable_kv_routing


@pytest.mark.parametrize("backend", ["kubernetes", "etcd", "file", "mem"])
def test_every_dynamo_discovery_backend_accepted(model_dir: Path, backend: str) -> None:
    _, worker = parse_args(
        ["--engine", "h:1", "--model-path", str(model_dir), "--discovery-backend", backend]
    )
    assert worker.discovery_backend == backend


def test_a_bad_bridge_command_line_exits_naming_the_problem(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(model_dir)])
    assert "--engine is required" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        parse_args(["--engine", "h:1", "--model-path", str(empty)])
    assert "lacks config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(
            ["--engine", "h:1", "--model-path", str(model_dir), "--discovery-backend", "zookeeper"]
        )
    with pytest.raises(SystemExit):
        parse_args(["--engine", "h:1", "--model-path", str(model_dir), "--generate-pacing", "1"])
    assert "--generate-pacing" in capsys.readouterr().err


def test_bridge_logger_survives_dynamo_logging_takeover(
    capsys: pytest.CaptureFixture,
) -> None:
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        logger = configure_bridge_logging("debug")
        configure_dynamo_logging()  # what Worker.run() does first
        assert logger.level == logging.DEBUG and not logger.propagate
        assert [h.get_name() for h in logger.handlers] == ["bridge-stderr"]
        logging.getLogger(f"{LOGGER_NAME}.engine").debug("still here")
        assert "bridge.engine: still here" in capsys.readouterr().err
        configure_bridge_logging("info")  # idempotent
        assert len(logger.handlers) == 1 and logger.level == logging.INFO
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])


def test_dynamos_logging_takeover_leaves_nothing_in_the_temporary_folder(
    tmp_path: Path,
) -> None:
    # Left to itself, Dynamo writes SGLang's logging config there at every start.
    program = (
        "from bridge.logging import configure_bridge_logging; "
        "from dynamo.runtime.logging import configure_dynamo_logging; "
        "configure_bridge_logging(); configure_dynamo_logging()"
    )
    env = {k: v for k, v in os.environ.items() if k != SKIP_SGLANG_LOGGING_ENV}
    subprocess.run(
        [sys.executable, "-c", program],
        env={**env, "TMPDIR": str(tmp_path)},
        check=True,
        timeout=60,
    )
    assert list(tmp_path.iterdir()) == []
