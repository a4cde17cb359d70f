"""The shared end-to-end stack: simulated engine servers, bridges (with vllm and
torch unimportable) and one Dynamo frontend, all subprocesses on loopback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from procs import ProcessGroup, blocking_env, dynamo_env, wait_for_model

from engine_contract.v1 import engine_pb2_grpc as pb_grpc

MODEL = "tiny"
# A second model on its own engine server whose EOS is never the likeliest token,
# for requests that must run long without ignore_eos (which would also switch
# off the frontend's stop strings).
LONG_MODEL = "tiny-long"
BRIDGE_ARGS = ("--log-level", "debug")
# Routed experts on, so that rollouts carry them; EOS most likely at 5% of
# positions, so that some greedy rollouts end on EOS.
SIM_ARGS = (
    "--routed-experts",
    "4,2,8",
    "--eos-rate",
    "0.05",
    "--decode-step-ms",
    "2",
    "--max-new-tokens",
    "48",
)
LONG_SIM_ARGS = ("--eos-rate", "0", "--decode-step-ms", "2")


@dataclass
class Stack:
    base_url: str
    engines: dict[str, str]  # served model name -> engine server address
    model_dir: Path
    group: ProcessGroup
    model: str = MODEL

    @property
    def engine_address(self) -> str:
        return self.engines[self.model]

    def engine_stub(self, model: str = MODEL) -> tuple[grpc.Channel, pb_grpc.EngineServiceStub]:
        channel = grpc.insecure_channel(self.engines[model])
        return channel, pb_grpc.EngineServiceStub(channel)


def start_stack(root: Path, model_dir: Path, group: ProcessGroup) -> Stack:
    """Two models, each on its own sim engine server and bridge, behind one frontend."""
    env = dynamo_env(root / "kv")
    bridge_env = {**env, **blocking_env("vllm", "torch")}
    engines: dict[str, str] = {}
    procs = []
    for model, args in ((MODEL, SIM_ARGS), (LONG_MODEL, LONG_SIM_ARGS)):
        engine, address = group.engine_server(
            f"engine-{model}", "--model", str(model_dir), "--served-model-name", model, *args
        )
        bridge = group.bridge(
            f"bridge-{model}", address, model_dir, model, f"ns-{model}", bridge_env, *BRIDGE_ARGS
        )
        engines[model] = address
        procs += [engine, bridge]
    frontend, base_url = group.frontend("frontend", env)
    for model in engines:
        wait_for_model(base_url, model, [*procs, frontend])
    return Stack(base_url, engines, model_dir, group)
