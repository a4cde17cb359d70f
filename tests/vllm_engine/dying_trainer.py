"""A trainer killed part way through a refit over ``gloo`` (test_vllm_gloo_transfer.py):

    python -m tests.vllm_engine.dying_trainer ENGINE_ADDRESS CHECKPOINT WHEN

As NeMo RL's trainer does with vLLM 0.23's static API: it opens rank 0 while the
engine server's worker joins, starts the update, then sends CHECKPOINT's tensors,
each a chunk of its own (``packed: false``: the worker loads whole layers as they
come), and is killed (SIGKILL) part way. WHEN:

- ``during-broadcast``: half of its tensors broadcast in the one round, the rest never;
- ``between-rounds``: a first round (half of its tensors) sent whole, the second never.

Prints each step it reached; its exit status is -9.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine_server.backends.vllm._env import apply_env_defaults

apply_env_defaults()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine_server.weight_transfer_gloo import GlooWeightTransferEngine  # noqa: E402
from harness.ports import free_port  # noqa: E402
from rl_client.weight_sync import ContractWeightSyncClient  # noqa: E402

WHEN = ("during-broadcast", "between-rounds")


def say(step: str) -> None:
    print(step, flush=True)


def die() -> None:
    say("killed")
    os.kill(os.getpid(), signal.SIGKILL)


def update_info(params: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {
        "names": [name for name, _ in params],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
        "packed": False,
    }


def main(address: str, checkpoint: str, when: str) -> None:
    if when not in WHEN:
        raise SystemExit(f"WHEN: one of {', '.join(WHEN)}, not {when!r}")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    half = len(params) // 2
    client = ContractWeightSyncClient(address, weight_version="never", timeout_s=120)
    init: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": free_port()}
    init |= {"world_size": 2, "timeout_s": 20}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, {**init, "rank_offset": 1})
        group = GlooWeightTransferEngine.trainer_init(init)
        joined.result()
    say("initialized")
    client.start_weight_update()
    say("started")

    def first_half_then_die() -> Iterator[tuple[str, torch.Tensor]]:
        yield from params[:half]
        time.sleep(1)  # the worker receives and loads what was sent
        die()

    def send(round_params: list[tuple[str, torch.Tensor]], tensors: Any) -> None:
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(client.update_weights, update_info(round_params))
            GlooWeightTransferEngine.trainer_send_weights(
                tensors, {"group": group, "packed": False}
            )
            received.result()

    if when == "during-broadcast":
        send(params, first_half_then_die())
    send(params[:half], iter(params[:half]))
    say("first round sent")
    die()


if __name__ == "__main__":
    main(*sys.argv[1:])
