"""Flags built from config dataclass fields (engine_contract.flags): a default
written once, the unit rule, and old spellings still accepted with a warning."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_contract import flags
from engine_contract.flags import add_fields, flag, from_args
from engine_server.cli import build_parser, config_from_args
from engine_server.config import Limits, RefitConfig, ServerConfig


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "_warned", set())


@dataclass(frozen=True)
class Toy:
    wait_s: float = field(default=1.5, metadata=flag("a wait", old=("--wait",)))
    deadline_s: float | None = field(default=None, metadata=flag("a deadline", off=True))
    dirs: tuple[Path, ...] = field(default=(), metadata=flag("a dir", name="--dir"))
    on: bool = field(default=False, metadata=flag("switch it on"))
    not_a_flag: int = 3


def toy_parser(**kwargs: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_fields(parser, Toy, **kwargs)  # type: ignore[arg-type]
    return parser


def toy(*argv: str, **kwargs: str) -> Toy:
    return Toy(**from_args(toy_parser(**kwargs).parse_args(list(argv)), Toy))


def test_defaults_come_from_the_fields() -> None:
    assert toy() == Toy()
    assert "--not-a-flag" not in toy_parser().format_help()


def test_types_off_repeated_and_bool_follow_the_annotations() -> None:
    got = toy("--wait-s", "2", "--deadline-s", "3", "--dir", "/a", "--dir", "/b", "--on")
    assert got == Toy(wait_s=2, deadline_s=3, dirs=(Path("/a"), Path("/b")), on=True)
    assert toy("--deadline-s", "0").deadline_s is None


def test_an_old_spelling_sets_the_same_value_and_warns_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert toy("--wait", "4").wait_s == toy("--wait-s", "4").wait_s == 4
    assert toy("--wait", "5").wait_s == 5
    err = capsys.readouterr().err
    assert err.count("--wait is deprecated") == 1 and "use --wait-s" in err
    toy("--wait-s", "4")
    assert capsys.readouterr().err == ""


def help_text(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())


def test_help_shows_the_default_and_the_old_spelling_stays_hidden() -> None:
    text = help_text(toy_parser())
    assert re.search(r"a wait \(formerly --wait, still accepted\) \(default: 1.5\)", text)
    assert "--wait " not in text.replace("--wait-s", "")


def test_env_prefix_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOY_WAIT_S", "7")
    assert toy(env_prefix="TOY_").wait_s == 7
    assert toy("--wait-s", "8", env_prefix="TOY_").wait_s == 8
    assert "env var: TOY_WAIT_S | default: 1.5" in help_text(toy_parser(env_prefix="TOY_"))
    monkeypatch.setenv("TOY_ON", "0")
    assert not toy(env_prefix="TOY_").on
    monkeypatch.setenv("TOY_ON", "true")
    assert toy(env_prefix="TOY_").on


def engine_config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser("sim").parse_args(list(argv)))


def test_engine_flag_defaults_are_the_dataclass_defaults() -> None:
    assert engine_config() == ServerConfig()


def test_every_engine_field_with_flag_metadata_is_a_flag_and_reaches_its_field() -> None:
    parser = build_parser("sim")
    text = parser.format_help()
    for cls, prefix in ((ServerConfig, ""), (Limits, ""), (RefitConfig, "refit-")):
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("cli")
            if spec is None:
                continue
            name = spec.flag or "--" + prefix + f.name.replace("_", "-")
            assert name in text, name
    cfg = engine_config(
        "--max-message-bytes",
        "1024",
        "--max-kv-subscribers",
        "3",
        "--max-waiting-requests",
        "9",
        "--kv-replay-batches",
        "11",
        "--allow-remote",
        "--listen",
        "0.0.0.0:1",
        "--start-paused",
    )
    assert (cfg.limits.max_message_bytes, cfg.limits.max_kv_subscribers) == (1024, 3)
    assert (cfg.limits.max_waiting_requests, cfg.kv_replay_batches) == (9, 11)
    assert cfg.allow_remote and cfg.listen == "0.0.0.0:1" and cfg.start_paused


def test_engine_flags_follow_the_unit_rule() -> None:
    """A duration ends in -s or -ms, a size in -bytes (never -mib, -timeout alone)."""
    options = [
        o
        for action in build_parser("sim")._actions
        for o in action.option_strings
        if o.startswith("--")
    ]
    for option in options:
        assert not option.endswith(("-timeout", "-mib", "-interval")), option
