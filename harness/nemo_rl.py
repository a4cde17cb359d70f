"""NeMo RL's managed Dynamo runtime as its launcher builds it, for tests that replay it:
the worker's ``python -m dynamo.vllm`` command line (its ``arguments.build_dynamo_vllm_argv``)
run as ``python -m engine_worker``, the environment its worker pool sets, the
frontend's flags (``build_dynamo_frontend_argv``), and a rollout as its
``_build_completion_request`` posts it and its ``_parse_dynamo_completion_response``
reads it, and its trainer's weight push over ``gloo``.

    worker = start_worker(stack, "worker-0", *worker_argv(model_dir, "m", ns, GLOO))
    stack.start_frontend(*frontend_args(ns))
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.env import ONE_MACHINE_FLAGS
from harness.ports import free_port, free_system_port
from harness.procs import Proc
from harness.stack import Stack

# NeMo RL's own planes (managed runtime): etcd discovery, TCP requests, KV events over NATS.
NEMO_RL_PLANES = (
    "--discovery-backend",
    "etcd",
    "--request-plane",
    "tcp",
    "--event-plane",
    "nats",
)
# The CPU stand-in for NeMo RL's '{"backend":"nccl"}' (engine_server.weight_transfer_gloo).
GLOO = '{"backend": "gloo"}'


def worker_argv(
    model_dir: Path,
    model: str,
    namespace: str,
    transfer: str,
    planes: Sequence[str] = ONE_MACHINE_FLAGS,
    seed: int = 7,
) -> list[str]:
    """NeMo RL's worker command line for an aggregated worker, its vLLM engine flags
    left to the caller: ``transfer`` its weight-transfer config ("" for none), and
    ``planes`` its discovery, request and event planes (``NEMO_RL_PLANES`` as NeMo RL
    runs it; by default the file and ZMQ planes of one machine)."""
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        model,
        "--namespace",
        namespace,
        *planes,
        "--enable-rl",
        *(["--weight-transfer-config", transfer, "--trust-remote-code"] if transfer else []),
        "--seed",
        str(seed),
        "--no-exclude-tools-when-tool-choice-none",
        "--no-dyn-enable-structural-tag",
        "--endpoint-types",
        "completions",
    ]


@dataclass(frozen=True)
class Worker:
    """A ``python -m engine_worker`` process and its system port (the RL routes)."""

    proc: Proc
    system_port: int

    @property
    def system_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}"


def worker_env(
    base: Mapping[str, str], system_port: int, control_timeout_s: float = 60
) -> dict[str, str]:
    """What NeMo RL's worker pool sets over ``base`` (the stack's Dynamo environment):
    the worker's own system port, its control timeout as the init-group bound, and
    the experimental parsers switch."""
    return {
        **base,
        "DYN_SYSTEM_PORT": str(system_port),
        "DYN_RL_INIT_WEIGHTS_TIMEOUT_S": f"{control_timeout_s:g}",
        "DYN_ENABLE_EXPERIMENTAL_PARSERS_V2": "1",
    }


def start_worker(stack: Stack, name: str, *args: str, control_timeout_s: float = 60) -> Worker:
    """``python -m engine_worker ARGS`` in NeMo RL's environment, on a free system
    port below 32768 (Dynamo 1.6.1 reads ``DYN_SYSTEM_PORT`` as an i16); returns at once."""
    port = free_system_port()
    argv = [sys.executable, "-m", "engine_worker", *args]
    proc = stack.group.spawn(name, argv, worker_env(stack.env, port, control_timeout_s))
    return Worker(proc, port)


def frontend_args(
    namespace: str, router_mode: str = "kv", planes: Sequence[str] = NEMO_RL_PLANES
) -> list[str]:
    """The frontend's flags after its HTTP host and port, as NeMo RL's managed runtime
    sets them (less ``--router-reset-states``, which Dynamo 1.6.1's frontend lacks)."""
    return ["--namespace-prefix", namespace, *planes, "--router-mode", router_mode]


def completion_body(
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One rollout as NeMo RL posts it to ``/v1/completions`` (one sample, token ids
    in, generated ids asked for in ``nvext.completion_token_ids``)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0 if greedy else temperature,
        "top_p": top_p,
        "top_k": 1 if greedy else (top_k if top_k is not None else -1),
        "n": 1,
        "logprobs": 0,
        "include_stop_str_in_output": True,
        "nvext": {"extra_fields": ["completion_token_ids"]},
    }
    if stop_token_ids is not None:
        body["stop_token_ids"] = list(stop_token_ids)
    if stop is not None:
        body["stop"] = list(stop)
    return body


@dataclass(frozen=True)
class Completion:
    """What NeMo RL keeps of an answer: the generated ids, their logprobs, and
    whether the budget cut it."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool


def parse_completion(body: Mapping[str, Any]) -> Completion:
    """An answer read as NeMo RL reads it: ids from ``nvext.completion_token_ids``,
    logprobs from ``choices[0].logprobs.token_logprobs`` (as many, all numbers),
    truncated when the finish reason is "length"; AssertionError otherwise."""
    choice = body["choices"][0]
    ids = (body.get("nvext") or {}).get("completion_token_ids")
    assert isinstance(ids, list), f"no nvext.completion_token_ids in {body!r:.600}"
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    assert len(logprobs) == len(ids), (len(logprobs), len(ids))
    assert all(isinstance(x, int | float) for x in logprobs), logprobs
    return Completion(
        [int(t) for t in ids], [float(x) for x in logprobs], choice["finish_reason"] == "length"
    )


def send_gloo_weights(weights: Path, client: Any, world_size: int) -> None:
    """A trainer's weight push as NeMo RL's refit runs it, over ``gloo`` (the CPU
    stand-in for NCCL): vLLM's plugins loaded (ours registers ``gloo``), the model at
    ``weights`` in float32, vLLM's own trainer engine as rank 0 of ``world_size`` on
    loopback, then its ``send_weights`` through ``client`` (start, update with the
    broadcast running, finish); the trainer shut down however it ends."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from engine_server.weight_transfer_gloo import GlooTrainerInitInfo

    load_general_plugins()  # what a trainer does: our plugin registers `gloo`
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    init = GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=world_size, rank=0
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        init, client=client, source=ModuleSource(model)
    )
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()
