"""The bridge's flags (the unit rule: -s, -ms, -bytes; launch.config_flags): the
old spellings gone, environment variables, and the command line a supervisor
writes (launch.bridge_command) read back as the same settings."""

from __future__ import annotations

import argparse
from operator import attrgetter
from pathlib import Path

import pytest

from bridge.client import ClientOptions
from bridge.config import MODEL_FILES, BridgeConfig, build_parser, parse_args
from launch.bridge_command import BridgeLaunch, bridge_argv

# Spellings from before the unit rule, removed: each is refused now.
REMOVED = (
    "--connect-timeout",
    "--control-timeout",
    "--abort-timeout",
    "--engine-stall-timeout",
    "--rollout-timeout",
    "--exit-after-engine-gone",
    "--max-message-mib",
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    for name in MODEL_FILES:
        (tmp_path / name).write_text("{}")
    return tmp_path


def bridge(model_dir: Path, *argv: str) -> BridgeConfig:
    config, _ = parse_args(
        [
            "--engine",
            "127.0.0.1:5",
            "--model-path",
            str(model_dir),
            "--discovery-backend",
            "file",
            *argv,
        ]
    )
    return config


@pytest.mark.parametrize("old", REMOVED)
def test_the_old_spellings_are_refused(
    model_dir: Path, old: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        bridge(model_dir, old, "3")
    assert exit.value.code == 2
    assert f"unrecognized arguments: {old} 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fields"),
    [
        pytest.param(
            (
                "--connect-timeout-s", "7",
                "--control-timeout-s", "3",
                "--abort-timeout-s", "2",
                "--engine-stall-timeout-s", "4",
                "--rollout-timeout-s", "60",
                "--exit-after-engine-gone-s", "9",
                "--max-message-bytes", "4096",
            ),
            {
                "connect_timeout_s": 7,
                "stall_timeout_s": 4,
                "rollout_timeout_s": 60,
                "exit_after_engine_gone_s": 9,
                "client.control_timeout_s": 3,
                "client.abort_timeout_s": 2,
                "client.max_message_bytes": 4096,
            },
            id="new-spellings-reach-their-fields",
        ),
        pytest.param(
            (
                "--engine-stall-timeout-s", "0",
                "--rollout-timeout-s", "0",
                "--exit-after-engine-gone-s", "0",
            ),
            {"stall_timeout_s": None, "rollout_timeout_s": None, "exit_after_engine_gone_s": None},
            id="zero-still-means-off",
        ),
    ],
)  # fmt: skip
def test_flags_reach_their_fields(
    model_dir: Path, argv: tuple[str, ...], fields: dict[str, object]
) -> None:
    """Each flag sets its field (``client.`` for the engine client's options)."""
    config = bridge(model_dir, *argv)
    assert {name: attrgetter(name)(config) for name in fields} == fields


def test_defaults_are_the_dataclasses(model_dir: Path) -> None:
    config = bridge(model_dir)
    default = BridgeConfig(engine_address="x", model_path="y")
    for name in (
        "connect_timeout_s",
        "rollout_transport",
        "generate_transport",
        "kv_max_delay_ms",
        "stall_timeout_s",
        "rollout_timeout_s",
        "exit_after_engine_gone_s",
        "log_level",
        "kv_events",
        "rl_routes",
        "enable_rl",
        "component",
    ):
        assert getattr(config, name) == getattr(default, name), name
    assert config.client == ClientOptions()
    # The one flag whose default is not its field's: a config built in code may
    # name no reachable store.
    assert config.catch_up and not default.catch_up


def test_environment_variables(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRIDGE_CONTROL_TIMEOUT_S", "12")
    monkeypatch.setenv("BRIDGE_ROLLOUT_TIMEOUT_S", "30")
    monkeypatch.setenv("BRIDGE_MAX_MESSAGE_MIB", "2")  # gone: no effect
    monkeypatch.setenv("BRIDGE_LOG_LEVEL", "warning")
    monkeypatch.setenv("BRIDGE_CATCH_UP", "0")
    monkeypatch.setenv("DYN_ENABLE_RL", "true")
    config = bridge(model_dir)
    assert (config.client.control_timeout_s, config.rollout_timeout_s) == (12, 30)
    assert config.client.max_message_bytes == ClientOptions().max_message_bytes
    assert config.log_level == "WARNING" and not config.catch_up and config.enable_rl
    monkeypatch.setenv("BRIDGE_MAX_MESSAGE_BYTES", "5000")
    assert bridge(model_dir).client.max_message_bytes == 5000
    assert bridge(model_dir, "--max-message-bytes", "6000").client.max_message_bytes == 6000


def test_help_shows_each_flag_once_with_its_environment_variable() -> None:
    parser = build_parser()
    shown = {
        option: " ".join((action.help or "").split())
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }
    for old in REMOVED:
        assert old not in shown
    assert "formerly" not in " ".join(shown.values())
    assert "env var: BRIDGE_ENGINE_ADDRESS | default: None" in shown["--engine"]
    assert "env var: BRIDGE_GENERATE_PACING | default: on" in shown["--generate-pacing"]
    assert "env var: DYN_ENABLE_RL | default: False" in shown["--enable-rl"]
    assert "env var: BRIDGE_CATCH_UP | default: True" in shown["--catch-up"]
    assert "env var: BRIDGE_ENGINE_TLS_CA | default: None" in shown["--engine-tls-ca"]
    parser.format_help()  # every help text formats (no stray %)


def test_a_supervisors_command_line_reads_back_as_its_settings(model_dir: Path) -> None:
    launch = BridgeLaunch(
        engine_address="unix:/tmp/e.sock",
        model_path=str(model_dir),
        served_model_name="tiny",
        namespace="ns",
        exit_after_engine_gone_s=2.5,
    )
    argv = bridge_argv("python", launch, ["--discovery-backend", "file"])
    assert argv[:3] == ["python", "-m", "bridge"]
    config, worker = parse_args(argv[3:])
    for name in ("engine_address", "model_path", "served_model_name", "namespace"):
        assert getattr(config, name) == getattr(launch, name), name
    assert config.exit_after_engine_gone_s == 2.5 and worker.namespace == "ns"
    # Not given: the bridge's defaults (and environment) decide.
    bare = bridge_argv("python", BridgeLaunch(engine_address="a:1", model_path="/m"))
    assert bare[3:] == ["--engine", "a:1", "--model-path", "/m"]
