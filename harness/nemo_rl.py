"""NeMo RL's managed Dynamo runtime as its launcher builds it, for tests that replay it:
the worker's ``python -m dynamo.vllm`` command line (its ``arguments.build_dynamo_vllm_argv``)
run as ``python -m engine_worker``, the environment its worker pool sets, the
frontend's flags (``build_dynamo_frontend_argv``), and a rollout as its
``_build_completion_request`` posts it and its ``_parse_dynamo_completion_response``
reads it, its trainer's weight push over ``gloo``, and a worker's ``/metrics`` as
its ``DynamoMetricsSampler`` reads it (``sampler_metrics``).

    worker = start_worker(stack, "worker-0", *worker_argv(model_dir, "m", ns, GLOO))
    stack.start_frontend(*frontend_args(ns))
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.env import ONE_MACHINE_FLAGS
from harness.http import http_json
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


def frontend_has_router_reset_states() -> bool:
    """Whether the installed Dynamo's frontend takes ``--router-reset-states`` (1.3.x
    does; 1.6.1's refuses it and exits)."""
    from bridge.dynamo_compat import frontend_router_reset_flags

    return bool(frontend_router_reset_flags(True))


def frontend_args(
    namespace: str,
    router_mode: str = "kv",
    planes: Sequence[str] = NEMO_RL_PLANES,
    router_reset_states: bool = False,
) -> list[str]:
    """The frontend's flags after its HTTP host and port, as NeMo RL's managed runtime
    sets them (its ``build_dynamo_frontend_argv``): ``--router-reset-states`` or
    ``--no-router-reset-states`` always, where the installed frontend has the flag
    (Dynamo 1.3.x); a 1.6.1 frontend refuses either spelling, so it goes there."""
    from bridge.dynamo_compat import frontend_router_reset_flags

    reset = frontend_router_reset_flags(router_reset_states)
    return ["--namespace-prefix", namespace, *planes, "--router-mode", router_mode, *reset]


def ready_fleet(base_url: str, namespace: str, workers: int, model: str) -> list[str] | None:
    """NeMo RL's readiness rule, as its ``ManagedDynamoRuntime._wait_for_frontend``
    applies it to the frontend's ``/health``: among ``instances`` of ``namespace``
    and component ``backend``, the ids of endpoint ``generate`` and of endpoint
    ``rl`` are ``workers`` each and the same set, and then ``/v1/models`` lists
    ``model``. The ids (sorted, as strings) when ready, else None."""
    status, health = http_json(f"{base_url}/health", timeout=5)
    if status != 200 or not isinstance(health, dict):
        return None
    ids: dict[str, set[str]] = {"generate": set(), "rl": set()}
    for instance in health.get("instances", []):
        if not isinstance(instance, dict) or instance.get("instance_id") is None:
            continue
        if instance.get("namespace") != namespace or instance.get("component") != "backend":
            continue
        if instance.get("endpoint") in ids:
            ids[str(instance["endpoint"])].add(str(instance["instance_id"]))
    if not (len(ids["generate"]) == len(ids["rl"]) == workers and ids["generate"] == ids["rl"]):
        return None
    status, models = http_json(f"{base_url}/v1/models", timeout=5)
    listed = {
        str(m["id"])
        for m in (models or {}).get("data", [])
        if isinstance(m, dict) and m.get("id") is not None
    }
    return sorted(ids["generate"]) if status == 200 and model in listed else None


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
    ``weights`` in float32, rank 0 of ``world_size`` on loopback, then one round through
    ``client`` (start, update with the broadcast running, finish); the trainer's group
    shut down however it ends. vLLM 0.32 drives it with its own trainer engine
    (``send_weights``); vLLM 0.23, NeMo RL's pin, has none, and its trainers call the
    engine's static ``trainer_init`` and ``trainer_send_weights`` around the workers'
    calls, as NeMo RL does with NCCL's."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.plugins import load_general_plugins

    from engine_server.vllm_compat import HAS_TRAINER_ENGINES

    load_general_plugins()  # what a trainer does: our plugin registers `gloo`
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    if HAS_TRAINER_ENGINES:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from engine_server.weight_transfer_gloo import GlooTrainerInitInfo

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
        return
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    static_gloo_round(client, params, world_size)


def static_gloo_round(
    client: Any,
    params: Sequence[tuple[str, Any]],
    world_size: int,
    init_extra: Mapping[str, Any] | None = None,
    update_extra: Mapping[str, Any] | None = None,
) -> None:
    """One refit over ``gloo`` with vLLM 0.23's static trainer API (the engine's
    ``trainer_init`` while ``client``'s workers join with ``init_extra``, then their
    start, their update (names, dtypes, shapes, plus ``update_extra``) while
    ``trainer_send_weights`` broadcasts ``params`` packed, their finish); the group
    shut down however it ends."""
    from engine_server.weight_transfer_gloo import GlooWeightTransferEngine

    init_info: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": free_port()}
    init_info["world_size"] = world_size
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            client.init_weight_transfer_engine, {**init_info, **(init_extra or {})}
        )
        group = GlooWeightTransferEngine.trainer_init(init_info)
        joined.result()
    update = {
        "names": [name for name, _ in params],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
        **(update_extra or {}),
    }
    try:
        client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(client.update_weights, update)
            GlooWeightTransferEngine.trainer_send_weights(
                iter(params), {"group": group, "packed": True}
            )
            received.result()
        client.finish_weight_update()
    finally:
        group.shutdown()


# The vLLM series NeMo RL's DynamoMetricsSampler keeps by default (the vLLM part of
# its metrics.py's CURATED_METRICS_INCLUDE_PREFIXES; the rest are Dynamo's own
# dynamo_component_* and dynamo_work_handler_* series), and what it leaves out.
SAMPLER_VLLM_PREFIXES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens",
    "vllm:prompt_tokens_total",
    "vllm:inter_token_latency",
)
SAMPLER_EXCLUDED_PREFIXES = ("python_", "process_")


def sampler_metrics(
    text: str, include: tuple[str, ...] = SAMPLER_VLLM_PREFIXES
) -> dict[str, float]:
    """A ``/metrics`` scrape as NeMo RL's ``parse_prometheus_metrics`` (its
    ``dynamo/metrics.py``) reads it, written here from its rules: sample lines only;
    the name is what precedes ``{`` (or the first blank), the value the first word
    after the last ``}`` (or the name); ``_bucket`` and ``_created`` samples, names
    outside ``include`` and ``python_``/``process_`` ones skipped; every label set
    of a name summed, under the name with ``:`` made ``_``
    (``vllm:generation_tokens_total`` -> ``vllm_generation_tokens_total``)."""
    found: dict[str, float] = {}
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, close = line.split("{", 1)[0], line.rfind("}")
            if close < 0:
                continue
            rest = line[close + 1 :]
        else:
            parts = line.split(None, 1)
            if len(parts) != 2:
                continue
            name, rest = parts
        if name.endswith(("_bucket", "_created")) or not name.startswith(include):
            continue
        if name.startswith(SAMPLER_EXCLUDED_PREFIXES) or not rest.split():
            continue
        try:
            value = float(rest.split()[0])
        except ValueError:
            continue
        key = name.replace(":", "_")
        found[key] = found.get(key, 0.0) + value
    return found
