"""TLS: server certificate, and client certificates when a client CA is configured."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, sim_cli_args


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def start(pki: Path, client_ca: bool) -> InProcessServer:
    extra = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    if client_ca:
        extra += ["--tls-client-ca", str(pki / "ca.pem")]
    return InProcessServer.from_cli(*sim_cli_args(*extra)).start()


def info(address: str, credentials: grpc.ChannelCredentials) -> pb.GetServerInfoResponse:
    with grpc.secure_channel(address, credentials) as channel:
        return pb_grpc.EngineServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=5
        )


def test_a_tls_server_answers_clients_trusting_its_ca_and_refuses_plaintext(pki: Path) -> None:
    server = start(pki, client_ca=False)
    try:
        trusted = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        assert info(server.address, trusted).instance_id
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
            pb_grpc.EngineServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=2)
    finally:
        server.stop()


def test_tls_client_certificates_required_when_configured(pki: Path) -> None:
    server = start(pki, client_ca=True)
    try:
        ca = (pki / "ca.pem").read_bytes()
        with pytest.raises(grpc.RpcError):
            info(server.address, grpc.ssl_channel_credentials(ca))
        with_cert = grpc.ssl_channel_credentials(
            ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
        )
        assert info(server.address, with_cert).instance_id
    finally:
        server.stop()
