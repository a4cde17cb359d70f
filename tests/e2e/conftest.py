"""One real stack per session: a simulated engine server, a bridge (with vllm and
torch unimportable) and a Dynamo frontend, all subprocesses on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from procs import ProcessGroup, blocking_env, dynamo_env, tiny_model_dir, wait_for_model

from engine_contract.v1 import engine_pb2_grpc as pb_grpc

MODEL = "tiny"
NAMESPACE = "e2e"
# Routed experts on, so that rollouts carry them; EOS most likely at 5% of
# positions, so that some greedy rollouts end on EOS.
BRIDGE_ARGS = ("--log-level", "debug")
SIM_ARGS = ("--served-model-name", MODEL, "--routed-experts", "4,2,8", "--eos-rate", "0.05",
            "--decode-step-ms", "2", "--max-new-tokens", "48")


@dataclass
class Stack:
    base_url: str
    engine_address: str
    model: str
    model_dir: Path
    group: ProcessGroup

    def engine_stub(self) -> tuple[grpc.Channel, pb_grpc.EngineServiceStub]:
        channel = grpc.insecure_channel(self.engine_address)
        return channel, pb_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e-stack")
    env = dynamo_env(root / "kv")
    with ProcessGroup(root / "logs") as group:
        engine, address = group.engine_server("engine", "--model", str(model_dir), *SIM_ARGS)
        bridge = group.bridge("bridge", address, model_dir, MODEL, NAMESPACE,
                              {**env, **blocking_env("vllm", "torch")}, *BRIDGE_ARGS)
        frontend, base_url = group.frontend("frontend", env)
        wait_for_model(base_url, MODEL, [engine, bridge, frontend])
        yield Stack(base_url, address, MODEL, model_dir, group)
