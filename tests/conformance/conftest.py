"""The conformance suite's engine servers.

Without ``--engine-address`` every test runs against the simulated engine
served in-process and served by the CLI as a subprocess, against the toy
backend (the README's example of a backend), and, where vLLM is installed,
against the vLLM engine server. With it, against that address
only: ``make conformance ADDR=HOST:PORT``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, sim_cli_args, tiny_vllm_args
from harness.env import importable
from harness.procs import ProcessGroup

# Sim settings shared by both sim servers: a decode pace slow enough that
# cancellation and abort tests catch requests mid-way, and a small message
# limit so the oversized-message test stays cheap.
SIM_DECODE_STEP_MS = 2.0
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_address" in metafunc.fixturenames:
        kinds: list[object]
        if metafunc.config.getoption("--engine-address"):
            kinds = ["external"]
        else:
            kinds = ["inproc-sim", "cli-sim", "cli-toy"]
            if importable("vllm"):
                kinds.append(pytest.param("cli-vllm", marks=pytest.mark.vllm))
        metafunc.parametrize("engine_address", kinds, indirect=True, scope="session")


def _sim_args(model: Path) -> list[str]:
    return [
        "--model",
        str(model),
        "--decode-step-ms",
        str(SIM_DECODE_STEP_MS),
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
        "--max-new-tokens",
        "64",
        "--routed-experts",
        "4,2,8",
    ]


def _toy_args(model: Path) -> list[str]:
    """The hundred-line example backend (README "Writing a backend")."""
    return ["--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-new-tokens", "64"]


def _vllm_args(model: Path) -> list[str]:
    """The tiny model on vLLM's CPU build (or GPU build): small, fp32, eager."""
    return [
        "--model",
        str(model),
        *tiny_vllm_args(max_model_len=512),
        "--block-size",
        "32",
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
        "--max-new-tokens",
        "64",
    ]


@pytest.fixture(scope="session")
def engine_address(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    kind = request.param
    if kind == "external":
        yield request.config.getoption("--engine-address")
        return
    model = request.getfixturevalue("model_dir")
    if kind == "inproc-sim":
        server = InProcessServer.from_cli(*sim_cli_args(*_sim_args(model))).start()
        try:
            yield server.address
        finally:
            server.stop()
        return
    backend = kind.removeprefix("cli-")
    args = {"vllm": _vllm_args, "sim": _sim_args, "toy": _toy_args}[backend](model)
    with ProcessGroup(tmp_path_factory.mktemp(kind)) as group:
        proc, address = group.engine_server("server", *args, backend=backend, timeout=180)
        yield address
        assert proc.stop(timeout=30) == 0, proc.log_tail()


@pytest.fixture(scope="session")
def server_info(engine_address: str) -> pb.GetServerInfoResponse:
    with grpc.insecure_channel(engine_address) as channel:
        return pb_grpc.EngineServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=30, wait_for_ready=True
        )


@pytest_asyncio.fixture
async def stub(engine_address: str) -> AsyncIterator[pb_grpc.EngineServiceStub]:
    async with grpc.aio.insecure_channel(
        engine_address,
        options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    ) as channel:
        yield pb_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="session")
def tokenizer(server_info: pb.GetServerInfoResponse):  # type: ignore[no-untyped-def]
    """The served model's tokenizer, when its files are on this machine."""
    path = Path(server_info.model_path) / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"no local tokenizer at {path}: text-level checks need it")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
