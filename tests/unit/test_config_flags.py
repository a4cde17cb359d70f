"""Flags built from config dataclass fields (launch.config_flags): a default
written once, the unit rule, named values, negatable and turning-off switches,
flags that override a config made elsewhere, the environment, and a config
written back as the command line that gives it."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_server.cli import build_parser, config_from_args
from engine_server.config import GenerationDefaults, Limits, RefitConfig, ServerConfig, TlsConfig
from launch.config_flags import add_fields, external, flag, from_args, to_argv


@dataclass(frozen=True)
class Toy:
    wait_s: float = field(default=1.5, metadata=flag("a wait"))
    deadline_s: float | None = field(default=None, metadata=flag("a deadline", off=True))
    dirs: tuple[Path, ...] = field(default=(), metadata=flag("a dir", name="--dir"))
    on: bool = field(default=False, metadata=flag("switch it on"))
    events: bool = field(default=True, metadata=flag("no events", name="--no-events"))
    routes: bool = field(default=True, metadata=flag("routes", negatable=True))
    pacing: bool = field(default=True, metadata=flag("pace", choices={"on": True, "off": False}))
    level: str = field(default="info", metadata=flag("a level", choices=("info", "debug")))
    catch_up: bool = field(default=False, metadata=flag("catch up", negatable=True, default=True))
    other: str | None = field(default=None, metadata=external("--other"))
    not_a_flag: int = 3


def toy_parser(**kwargs: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_fields(parser, Toy, **kwargs)  # type: ignore[arg-type]
    return parser


def toy(*argv: str, **kwargs: str) -> Toy:
    return Toy(**from_args(toy_parser(**kwargs).parse_args(list(argv)), Toy))


def help_text(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())


def test_defaults_come_from_the_fields() -> None:
    got = toy()
    # The command line's own default where the flag says so (catch_up).
    assert got == Toy(catch_up=True)
    text = help_text(toy_parser())
    assert "--not-a-flag" not in text and "--other" not in text
    assert re.search(r"a wait \(default: 1.5\)", text)


def test_types_off_repeated_and_bool_follow_the_annotations() -> None:
    got = toy("--wait-s", "2", "--deadline-s", "3", "--dir", "/a", "--dir", "/b", "--on")
    assert (got.wait_s, got.deadline_s, got.dirs, got.on) == (2, 3, (Path("/a"), Path("/b")), True)
    assert toy("--deadline-s", "0").deadline_s is None


def test_switches_named_values_and_choices() -> None:
    assert not toy("--no-events").events and toy().events
    assert not toy("--no-routes").routes and toy("--routes").routes
    assert not toy("--no-catch-up").catch_up
    assert not toy("--pacing", "off").pacing and toy("--pacing", "on").pacing
    assert toy("--level", "debug").level == "debug"
    for argv in (["--pacing", "maybe"], ["--level", "loud"]):
        with pytest.raises(SystemExit):
            toy(*argv)


def test_a_named_value_is_refused_in_argparses_words(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        toy("--pacing", "maybe")
    assert "invalid choice: 'maybe' (choose from 'on', 'off')" in capsys.readouterr().err
    assert "--pacing {on,off}" in toy_parser().format_help()


def test_env_prefix_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOY_WAIT_S", "7")
    assert toy(env_prefix="TOY_").wait_s == 7
    assert toy("--wait-s", "8", env_prefix="TOY_").wait_s == 8
    assert "env var: TOY_WAIT_S | default: 1.5" in help_text(toy_parser(env_prefix="TOY_"))
    assert "env var: TOY_PACING | default: on" in help_text(toy_parser(env_prefix="TOY_"))
    monkeypatch.setenv("TOY_ON", "0")
    assert not toy(env_prefix="TOY_").on
    monkeypatch.setenv("TOY_ON", "true")
    assert toy(env_prefix="TOY_").on
    monkeypatch.setenv("TOY_PACING", "off")
    assert not toy(env_prefix="TOY_").pacing
    monkeypatch.setenv("TOY_ROUTES", "no")
    assert not toy(env_prefix="TOY_").routes


def test_an_environment_value_is_checked_as_the_flags_would_be(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOY_WAIT_S", "soon")
    with pytest.raises(SystemExit):
        toy(env_prefix="TOY_")
    assert "--wait-s: invalid float value: 'soon'" in capsys.readouterr().err


def test_overrides_default_to_not_given_and_show_the_fields_default() -> None:
    parser = argparse.ArgumentParser()
    add_fields(parser, GenerationDefaults, overrides=True)
    assert from_args(parser.parse_args([]), GenerationDefaults, overrides=True) == {}
    given = from_args(
        parser.parse_args(["--top-k", "3", "--stop-token-ids", "1,2"]),
        GenerationDefaults,
        overrides=True,
    )
    assert given == {"top_k": 3, "stop_token_ids": (1, 2)}
    text = help_text(parser)
    assert "sampling temperature (default: 1.0)" in text
    assert "default: the model's EOS ids" in text and "(default: ())" not in text


def test_to_argv_writes_what_from_args_reads_back() -> None:
    config = Toy(
        wait_s=2.5,
        deadline_s=4,
        dirs=(Path("/a"), Path("/b")),
        on=True,
        events=False,
        routes=False,
        pacing=False,
        level="debug",
        catch_up=True,
        other="x",
    )
    argv = to_argv(config)
    assert argv[-2:] == ["--other", "x"]  # another parser's: written, never read here
    assert dataclasses.replace(toy(*argv[:-2]), other="x") == config
    # None is "not given" (nothing written), and so is a switch left at its default.
    assert to_argv(Toy()) == [
        "--wait-s", "1.5", "--routes", "--pacing", "on", "--level", "info", "--no-catch-up",
    ]  # fmt: skip


def engine_config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser("sim").parse_args(list(argv)))


def test_engine_flag_defaults_are_the_dataclass_defaults() -> None:
    assert engine_config() == ServerConfig()


def test_every_engine_field_with_flag_metadata_is_a_flag_and_reaches_its_field() -> None:
    parser = build_parser("sim")
    text = parser.format_help()
    for cls, prefix in (
        (ServerConfig, ""),
        (Limits, ""),
        (RefitConfig, "refit-"),
        (TlsConfig, ""),
        (GenerationDefaults, ""),
    ):
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("cli")
            if spec is None:
                continue
            name = spec.name or "--" + prefix + f.name.replace("_", "-")
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
        "--metrics-port",
        "0",
    )
    assert (cfg.limits.max_message_bytes, cfg.limits.max_kv_subscribers) == (1024, 3)
    assert (cfg.limits.max_waiting_requests, cfg.kv_replay_batches) == (9, 11)
    assert cfg.allow_remote and cfg.listen == "0.0.0.0:1" and cfg.start_paused
    assert cfg.metrics_port == 0


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
