"""GPU check: the refit paths the CPU build cannot run, on a real vLLM engine server.

vLLM's weight-transfer engines (NCCL) and sleep mode need CUDA, so CI cannot
run them. This script is the check for a CUDA machine with the ``vllm`` extra
installed. Self-contained: builds the tiny model's checkpoints A and B offline,
starts ``python -m engine_server --backend vllm`` on A with
``--weight-transfer-config '{"backend": "nccl"}' --enable-sleep-mode``, and:

- the server states ``rl_capabilities`` (weight transfer "nccl", sleep);
- NCCL: this process loads B on the GPU and sends it with vLLM's own
  ``NCCLTrainerWeightTransferEngine`` driven over the contract
  (``rl_client.weight_sync.ContractWeightSyncClient``), between Pause and Resume: greedy
  rollouts then equal those after ``UpdateWeightsFromPath(B)`` on the same
  server, tokens and logprobs, and carry the version the update set;
- sleep: ``Sleep(level 1)`` frees GPU memory (``torch.cuda.mem_get_info`` seen
  from this process), health turns NOT_SERVING, ``WakeUp`` serves the same
  outputs as before the sleep;
- ``ShutdownWeightTransferEngine`` answers OK.

    python -m scripts.gpu_check_refit [--keep DIR]

Prints one line per check and PASS or FAIL last; results also in
``$OUT/gpu_check_refit.json`` when ``OUT`` is set. Exit status 0 on PASS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path


def greedy(stub, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list]]:  # type: ignore[no-untyped-def]
    from harness.engine import greedy_rollout, tokens_and_logprobs, version_spans

    out = []
    for prompt in prompts:
        answer = greedy_rollout(stub, prompt, 24, timeout=120)
        out.append((*tokens_and_logprobs(answer), version_spans(answer)))
    return out


def check(work: Path, results: dict[str, object]) -> list[str]:
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from engine_contract.v1 import engine_pb2 as pb
    from engine_contract.v1 import engine_pb2_grpc as pb_grpc
    from harness.checkpoints import tiny_weights_dir
    from harness.ports import free_port
    from harness.procs import ProcessGroup
    from harness.tiny_model import tiny_model_dir
    from rl_client.weight_sync import ContractWeightSyncClient

    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        results[what] = ok
        if not ok:
            failures.append(what)

    model_a, model_b = tiny_model_dir(), tiny_weights_dir(1)
    prompts = [[(s * 131 + i * 17) % 1000 + 3 for i in range(8 + s)] for s in range(6)]
    with ProcessGroup(work / "logs") as group:
        _, address = group.engine_server(
            "engine",
            "--model",
            str(model_a),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.3",
            "--weight-transfer-config",
            '{"backend": "nccl"}',
            "--enable-sleep-mode",
            backend="vllm",
            timeout=600,
        )
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.EngineServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        caps = info.rl_capabilities
        expect(
            caps.weight_transfer_backend == "nccl",
            f"weight transfer backend {caps.weight_transfer_backend!r}",
        )
        expect(caps.sleep, "sleep mode served")

        before = greedy(stub, prompts)
        # The reference: B loaded from its folder on this same server.
        stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
        stub.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(model_b)), timeout=300)
        stub.ResumeGeneration(pb.ResumeGenerationRequest())
        reference_b = greedy(stub, prompts)
        stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
        stub.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(model_a)), timeout=300)
        stub.ResumeGeneration(pb.ResumeGenerationRequest())
        expect(
            [r[:2] for r in greedy(stub, prompts)] == [r[:2] for r in before],
            "back on A from its folder: A's outputs",
        )

        # NCCL: B from this process's GPU memory, sent by vLLM's trainer engine.
        trainer_model = LlamaForCausalLM.from_pretrained(str(model_b), dtype=torch.float32).cuda()
        client = ContractWeightSyncClient(address, weight_version="nccl-b", timeout_s=300)
        init = NCCLTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=2
        )
        started = time.monotonic()
        engine = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=client, source=ModuleSource(trainer_model)
        )
        stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
        engine.send_weights()
        stub.ResumeGeneration(pb.ResumeGenerationRequest())
        results["nccl_seconds"] = round(time.monotonic() - started, 3)
        after = greedy(stub, prompts)
        expect(
            [r[:2] for r in after] == [r[:2] for r in reference_b],
            "NCCL-sent B serves what B from its folder serves (tokens, logprobs)",
        )
        expect(
            all(r[2] == [("nccl-b", 0, len(r[0]))] for r in after),
            "rollouts carry the version FinishWeightUpdate set",
        )

        # Sleep and wake.
        free_before, _ = torch.cuda.mem_get_info()
        stub.Sleep(pb.SleepRequest(level=1))
        time.sleep(1.0)
        free_asleep, _ = torch.cuda.mem_get_info()
        results["freed_bytes"] = free_asleep - free_before
        expect(
            free_asleep > free_before,
            f"sleep freed {free_asleep - free_before} bytes of GPU memory",
        )
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        expect(status == health_pb2.HealthCheckResponse.NOT_SERVING, "health NOT_SERVING asleep")
        expect(stub.IsSleeping(pb.IsSleepingRequest()).sleeping, "IsSleeping")
        expect(stub.WakeUp(pb.WakeUpRequest()).awake, "WakeUp: awake")
        time.sleep(0.5)
        woke = greedy(stub, prompts)
        expect([r[:2] for r in woke] == [r[:2] for r in after], "the same outputs after waking")
        client.shutdown_weight_transfer_engine()
        # The transfer engine gone, the served weights and their version stay.
        kept = greedy(stub, prompts)
        expect(
            [r[:2] for r in kept] == [r[:2] for r in after]
            and all(r[2] == [("nccl-b", 0, len(r[0]))] for r in kept),
            "after ShutdownWeightTransferEngine: the same outputs, still version nccl-b",
        )
        client.close()
        channel.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the logs in this folder")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="gpu-refit-"))
    results: dict[str, object] = {}
    try:
        failures = check(work, results)
    except Exception:
        traceback.print_exc()
        failures = ["exception"]
    results["pass"] = not failures
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check_refit.json").write_text(json.dumps(results, indent=1))
    print("PASS" if not failures else f"FAIL: {failures}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
