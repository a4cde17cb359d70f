"""The conformance suite's engine servers.

Without ``--engine-address`` every test runs against the simulated engine
served in-process and served by the CLI as a subprocess (and, in
tests/vllm, against the vLLM engine server). With it, against that address
only: ``make conformance ADDR=HOST:PORT``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from procs import tiny_model_dir
from servers import InProcessServer, ServerProcess, sim_cli_args

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc

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
            kinds = ["inproc-sim", "cli-sim"]
            if importlib.util.find_spec("vllm") is not None:
                kinds.append(pytest.param("cli-vllm", marks=pytest.mark.vllm))
        metafunc.parametrize("engine_address", kinds, indirect=True, scope="session")


def _start_inproc_sim(model: Path) -> InProcessServer:
    from engine_server.backends.sim import SimBackend
    from engine_server.cli import build_parser, config_from_args

    args = build_parser("sim").parse_args(_sim_args(model))
    return InProcessServer(SimBackend.from_cli_args(args), config_from_args(args)).start()


def _sim_args(model: Path) -> list[str]:
    return sim_cli_args(
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
    )


def _vllm_args(model: Path) -> list[str]:
    """The tiny model on vLLM's CPU build (or GPU build): small, fp32, eager."""
    return [
        "--backend",
        "vllm",
        "--listen",
        "127.0.0.1:0",
        "--model",
        str(model),
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
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
    model = tiny_model_dir()
    if kind == "inproc-sim":
        server = _start_inproc_sim(model)
        try:
            yield server.address
        finally:
            server.stop()
        return
    args = _vllm_args(model) if kind == "cli-vllm" else _sim_args(model)
    proc = ServerProcess(args, tmp_path_factory.mktemp(kind) / "server.log")
    try:
        yield proc.wait_ready(timeout=180)
    finally:
        assert proc.terminate() == 0, proc.log_text()


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
