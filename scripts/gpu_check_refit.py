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
- NeMo RL's bodies over NCCL: vLLM's trainer engine sends A back through a
  client that passes what NeMo RL's refit sends (``NemoRlBodies``): its init
  info (the rendezvous, plus ``"packed": true``, which vLLM 0.32 takes at init
  only) and ``"packed": true`` in every update's info, which the engine server
  checks against the init and drops (``backends/vllm/transfer_packing.py``):
  A's outputs again, under the version it set. Then an update whose
  ``"packed": false`` disagrees with that init: INVALID_ARGUMENT before the
  engine sees it, and the weights serving stay;
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
from typing import Any


def greedy(stub, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list]]:  # type: ignore[no-untyped-def]
    from harness.engine import greedy_rollout, tokens_and_logprobs, version_spans

    out = []
    for prompt in prompts:
        answer = greedy_rollout(stub, prompt, 24, timeout=120)
        out.append((*tokens_and_logprobs(answer), version_spans(answer)))
    return out


# NeMo RL's init info keys (nemo_rl/models/generation/dynamo/refit.py).
NEMO_RL_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size")


class NemoRlBodies:
    """A weight-sync client passing on what NeMo RL's refit sends (it was written
    for vLLM 0.23): the init info's rendezvous keys, plus ``"packed": true`` (vLLM
    0.32 packs only as the init says), and ``"packed": true`` in each update's info."""

    def __init__(self, client) -> None:  # type: ignore[no-untyped-def]
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict) -> None:  # type: ignore[type-arg]
        nemo = {key: init_info[key] for key in NEMO_RL_INIT_KEYS}
        self.client.init_weight_transfer_engine({**nemo, "packed": True})

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict) -> None:  # type: ignore[type-arg]
        self.client.update_weights({**update_info, "packed": True})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update()


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
    from harness.engine import prompt_of
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
    prompts = [prompt_of(8 + s, seed=s) for s in range(6)]
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

        def nccl_refit(weights: Path, client: object) -> tuple[Any, Any, float]:
            """``weights`` loaded on this process's GPU and sent by vLLM's NCCL trainer
            engine, set up through ``client``, between Pause and Resume; (the trainer
            engine, the model, the seconds from its rendezvous to the resume)."""
            model = LlamaForCausalLM.from_pretrained(str(weights), dtype=torch.float32).cuda()
            init = NCCLTrainerInitInfo(
                master_address="127.0.0.1", master_port=free_port(), world_size=2
            )
            started = time.monotonic()
            engine = NCCLTrainerWeightTransferEngine.trainer_init(
                init, client=client, source=ModuleSource(model)
            )
            stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
            engine.send_weights()
            stub.ResumeGeneration(pb.ResumeGenerationRequest())
            return engine, model, round(time.monotonic() - started, 3)

        # NCCL: B from this process's GPU memory, sent by vLLM's trainer engine.
        client = ContractWeightSyncClient(address, weight_version="nccl-b", timeout_s=300)
        engine, _, results["nccl_seconds"] = nccl_refit(model_b, client)
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
        engine.shutdown()
        client.close()

        # NeMo RL's bodies ("packed": true per update) over NCCL: A back from GPU memory.
        nemo_client = ContractWeightSyncClient(address, weight_version="nemo-a", timeout_s=300)
        nemo, trainer_a, results["nemo_rl_nccl_seconds"] = nccl_refit(
            model_a, NemoRlBodies(nemo_client)
        )
        back = greedy(stub, prompts)
        expect(
            [r[:2] for r in back] == [r[:2] for r in before]
            and all(r[2] == [("nemo-a", 0, len(r[0]))] for r in back),
            "NeMo RL's bodies ('packed': true per update) over NCCL: A's outputs, version nemo-a",
        )

        # A packing the group's init did not set: refused before the engine sees it
        # (else the worker would wait in a broadcast nobody sends: bounded calls).
        stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=60)
        stub.StartWeightUpdate(pb.StartWeightUpdateRequest(), timeout=60)
        unpacked = {
            "names": ["lm_head.weight"],
            "dtype_names": ["float32"],
            "shapes": [list(trainer_a.lm_head.weight.shape)],
            "packed": False,
        }
        refusal: grpc.RpcError | None = None
        try:
            stub.UpdateWeights(
                pb.UpdateWeightsRequest(update_info_json=json.dumps(unpacked).encode()),
                timeout=30,
            )
        except grpc.RpcError as e:
            refusal = e
        details = (refusal.details() or "") if refusal is not None else "accepted"
        results["disagreeing_packed"] = details
        expect(
            refusal is not None
            and refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "'packed' is false" in details
            and "set true" in details,
            "'packed': false against a packed init: INVALID_ARGUMENT naming both",
        )
        stub.FinishWeightUpdate(pb.FinishWeightUpdateRequest(), timeout=60)
        stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=60)
        expect(
            [r[:2] for r in greedy(stub, prompts)] == [r[:2] for r in back],
            "after the refused update: the weights serving stay",
        )
        nemo_client.shutdown_weight_transfer_engine()
        nemo.shutdown()
        nemo_client.close()
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
