"""The engine server's CLI: flags to ServerConfig, and bad flags refused with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_server.cli import build_parser, config_from_args


def config(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser("sim").parse_args(list(argv)))


def test_flags_reach_the_server_config() -> None:
    cfg = config(
        "--listen",
        "unix:/tmp/e.sock",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--max-new-tokens",
        "128",
        "--stop-token-ids",
        "2,7",
        "--grace-period-s",
        "3",
        "--max-stop-strings",
        "4",
        "--stream-write-timeout-s",
        "0",
        "--delta-hold-ms",
        "0.5",
        "--delta-hold-from",
        "8",
    )
    assert cfg.listen == "unix:/tmp/e.sock"
    assert (cfg.defaults.temperature, cfg.defaults.top_p, cfg.defaults.top_k) == (0.7, 0.9, 50)
    assert cfg.defaults.max_new_tokens == 128 and cfg.defaults.stop_token_ids == (2, 7)
    assert cfg.grace_period_s == 3 and cfg.limits.max_stop_strings == 4
    assert cfg.stream_write_timeout_s is None and cfg.tls is None
    assert (cfg.delta_hold_ms, cfg.delta_hold_from) == (0.5, 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--temperature", "-1"], "temperature"),
        (["--top-k", "-2"], "top-k"),
        (["--max-new-tokens", "-1"], "max-new-tokens"),
        (["--tls-cert", "c.pem"], "--tls-key"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca"),
        (["--stream-write-timeout-s", "-1"], "--stream-write-timeout-s"),
        (["--delta-hold-ms", "-1"], "delta hold must be >= 0 ms"),
        (["--delta-hold-from", "0"], "delta hold threshold"),
        # The refit deadlines cannot be switched off.
        (["--refit-check-timeout-s", "0"], "--refit-check-timeout-s) must be > 0 s"),
        (["--refit-timeout-s", "-1"], "--refit-timeout-s) must be > 0 s"),
        (["--refit-timeout-s", "nan"], "--refit-timeout-s) must be > 0 s"),
    ],
)
def test_bad_flags_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as err:
        config(*argv)
    assert message in str(err.value)


def test_refit_flags_reach_the_refit_config() -> None:
    cfg = config(
        "--refit-check-timeout-s",
        "5",
        "--refit-timeout-s",
        "90",
        "--weights-allowed-dir",
        "/ckpt",
        "--weights-allowed-dir",
        "/scratch/steps",
    )
    assert (cfg.refit.check_timeout_s, cfg.refit.timeout_s) == (5, 90)
    assert cfg.refit.allowed_dirs == (Path("/ckpt"), Path("/scratch/steps"))
    default = config().refit
    assert (default.check_timeout_s, default.timeout_s, default.allowed_dirs) == (60, 1800, ())


def test_bad_stop_token_list_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config("--stop-token-ids", "2,x")
    assert "comma-separated integers" in capsys.readouterr().err
