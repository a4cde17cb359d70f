"""The bridge's TLS client options: flags or environment (what engine_server.host's
``engine_env`` passes), and bad input refused naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import parse_args
from tests.remote.pki import Pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ca("ca")
    pki.leaf("client", "ca")
    return pki


def base(model_dir: Path) -> list[str]:
    return ["--engine", "10.0.0.5:50051", "--model-path", str(model_dir)]


def test_plaintext_unless_asked(model_dir: Path) -> None:
    bridge, _ = parse_args(base(model_dir))
    assert bridge.client.tls is None


def test_tls_from_the_environment(
    model_dir: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = pki.folder
    monkeypatch.setenv("BRIDGE_ENGINE_TLS_CA", str(d / "ca.pem"))
    monkeypatch.setenv("BRIDGE_ENGINE_TLS_CERT", str(d / "client.pem"))
    monkeypatch.setenv("BRIDGE_ENGINE_TLS_KEY", str(d / "client.key"))
    monkeypatch.setenv("BRIDGE_ENGINE_TLS_SERVER_NAME", "engine.internal")
    bridge, _ = parse_args(base(model_dir))
    tls = bridge.client.tls
    assert tls is not None
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        str(d / "ca.pem"),
        str(d / "client.pem"),
        str(d / "client.key"),
    )
    assert ("grpc.ssl_target_name_override", "engine.internal") in bridge.client.channel_options()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--engine-tls-cert", "{d}/client.pem"], "go together"),
        (["--engine-tls-ca", "{d}/missing.pem"], "--engine-tls-ca {d}/missing.pem: no such file"),
        (["--engine-tls-ca", "{d}/client.key"], "not a PEM CA bundle"),
        (
            ["--engine-tls-cert", "{d}/client.pem", "--engine-tls-key", "{d}/ca.key"],
            "not a certificate and its key",
        ),
        (["--engine-tls-server-name", "x"], "needs TLS"),
    ],
)
def test_bad_tls_options_refused(
    model_dir: Path, pki: Pki, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    d = pki.folder
    with pytest.raises(SystemExit):
        parse_args([*base(model_dir), *(a.format(d=d) for a in args)])
    assert words.format(d=d) in capsys.readouterr().err
