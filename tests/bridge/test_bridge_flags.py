"""The bridge's flags after the unit rule (-s, -ms, -bytes; engine_contract.flags):
new spellings, old ones still accepted with a warning, environment variables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bridge.client import MIB, ClientOptions
from bridge.config import MODEL_FILES, BridgeConfig, build_parser, parse_args
from engine_contract import flags

# old spelling -> (new spelling, value given, BridgeConfig attribute path, value expected)
RENAMED = {
    "--connect-timeout": ("--connect-timeout-s", "7", "connect_timeout_s", 7.0),
    "--control-timeout": ("--control-timeout-s", "3", "client.control_timeout_s", 3.0),
    "--abort-timeout": ("--abort-timeout-s", "2", "client.abort_timeout_s", 2.0),
    "--engine-stall-timeout": ("--engine-stall-timeout-s", "4", "stall_timeout_s", 4.0),
    "--rollout-timeout": ("--rollout-timeout-s", "60", "rollout_timeout_s", 60.0),
    "--exit-after-engine-gone": (
        "--exit-after-engine-gone-s",
        "9",
        "exit_after_engine_gone_s",
        9.0,
    ),
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "_warned", set())


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


def attr(config: object, path: str) -> object:
    for part in path.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_spelling_gives_the_new_ones_value_with_a_warning(
    model_dir: Path, old: str, capsys: pytest.CaptureFixture[str]
) -> None:
    new, value, path, expected = RENAMED[old]
    assert attr(bridge(model_dir, new, value), path) == expected
    assert capsys.readouterr().err == ""
    assert attr(bridge(model_dir, old, value), path) == expected
    err = capsys.readouterr().err
    assert f"{old} is deprecated" in err and f"use {new}" in err


def test_the_warning_comes_once(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bridge(model_dir, "--connect-timeout", "1")
    bridge(model_dir, "--connect-timeout", "2")
    assert capsys.readouterr().err.count("--connect-timeout is deprecated") == 1


def test_sizes_are_bytes_and_the_old_mib_flag_converts(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bridge(model_dir, "--max-message-bytes", "4096").client.max_message_bytes == 4096
    assert bridge(model_dir, "--max-message-mib", "8").client.max_message_bytes == 8 * MIB
    assert "--max-message-mib is deprecated" in capsys.readouterr().err


def test_zero_still_means_off(model_dir: Path) -> None:
    config = bridge(
        model_dir,
        "--engine-stall-timeout-s", "0",
        "--rollout-timeout", "0",
        "--exit-after-engine-gone-s", "0",
    )  # fmt: skip
    assert (config.stall_timeout_s, config.rollout_timeout_s) == (None, None)
    assert config.exit_after_engine_gone_s is None


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
    ):
        assert getattr(config, name) == getattr(default, name), name
    assert config.client == ClientOptions()


def test_environment_variables_new_and_old(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BRIDGE_CONTROL_TIMEOUT_S", "12")
    monkeypatch.setenv("BRIDGE_ROLLOUT_TIMEOUT_S", "30")
    monkeypatch.setenv("BRIDGE_MAX_MESSAGE_MIB", "2")
    config = bridge(model_dir)
    assert (config.client.control_timeout_s, config.rollout_timeout_s) == (12, 30)
    assert config.client.max_message_bytes == 2 * MIB
    assert "BRIDGE_MAX_MESSAGE_MIB is deprecated" in capsys.readouterr().err
    monkeypatch.setenv("BRIDGE_MAX_MESSAGE_BYTES", "5000")  # the new name wins
    assert bridge(model_dir).client.max_message_bytes == 5000


def test_help_names_the_new_spellings_only() -> None:
    parser = build_parser()
    shown = {
        option: action.help or ""
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }
    for old, (new, *_) in RENAMED.items():
        assert old not in shown and f"formerly {old}" in shown[new]
    assert "--max-message-bytes" in shown and "--max-message-mib" not in shown
    parser.format_help()  # every help text formats (no stray %)
