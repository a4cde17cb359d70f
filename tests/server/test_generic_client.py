"""A gRPC client this project did not write (buf curl) finds and calls the services
through reflection alone, with no .proto files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import engine_contract
from harness import ROOT
from harness.engine import InProcessServer, sim_cli_args

BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"


@pytest.fixture(scope="module")
def address() -> str:  # type: ignore[misc]
    if not BUF.exists():
        pytest.skip("buf is not installed (make proto-lint installs it)")
    server = InProcessServer.from_cli(*sim_cli_args()).start()
    yield server.address
    server.stop()


def buf_curl(*args: str) -> str:
    result = subprocess.run(
        [str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path("/"),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_lists_services_by_reflection(address: str) -> None:
    methods = buf_curl("--list-methods", f"http://{address}").split()
    assert "engine_contract.v1.EngineService/Rollout" in methods
    assert "engine_contract.v1.EngineService/GetServerInfo" in methods
    assert "grpc.health.v1.Health/Check" in methods


def test_calls_server_info_and_health(address: str) -> None:
    info = json.loads(
        buf_curl(
            "-d",
            json.dumps({"client_revision": engine_contract.CONTRACT_REVISION}),
            f"http://{address}/engine_contract.v1.EngineService/GetServerInfo",
        )
    )
    assert info["contractRevision"] == engine_contract.CONTRACT_REVISION
    assert info["backendName"] == "sim"
    health = json.loads(
        buf_curl(
            "-d",
            '{"service": "engine_contract.v1.EngineService"}',
            f"http://{address}/grpc.health.v1.Health/Check",
        )
    )
    assert health == {"status": "SERVING"}
