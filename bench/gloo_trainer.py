"""Part 6's trainer: vLLM's trainer-side ``gloo`` weight-transfer engine, in a child
process (torch, vLLM and the trainer's copies of the weights stay out of the
bench's own process and go when the part ends).

The child loads each checkpoint as a Hugging Face model, as a trainer holds its
policy, opens the transfer group with the engine server through
``WeightTransferTrainerFactory.trainer_init(..., client=ContractWeightSyncClient(...),
source=ModuleSource(model))``, then runs ``send_weights()`` (start, update while
it broadcasts, finish) whenever the parent asks, from the checkpoint it names.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"

# What the child answers: ("ready", None), ("sent", None) or ("error", traceback).
Answer = tuple[str, Any]


class GlooTrainer:
    """The parent's handle on the trainer child."""

    def __init__(
        self, address: str, checkpoints: Sequence[Path], log: Path, timeout_s: float = 600.0
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._timeout_s = timeout_s
        self._log = log
        self._proc = context.Process(
            target=serve,
            args=(child, address, [str(c) for c in checkpoints], str(log)),
            name="gloo-trainer",
            daemon=True,
        )
        self._proc.start()
        child.close()  # a child that dies ends the parent's reads (EOFError)
        try:
            self._answer("ready")
        except BaseException:
            self.close()
            raise

    def send(self, checkpoint: int, version: str) -> None:
        """``send_weights()`` from checkpoint ``checkpoint``, labelled ``version``."""
        self._conn.send((checkpoint, version))
        self._answer("sent")

    def _answer(self, expected: str) -> Any:
        if not self._conn.poll(self._timeout_s):
            raise TimeoutError(f"gloo trainer: no answer within {self._timeout_s:g} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"gloo trainer exited; see {self._log}") from None
        if kind != expected:
            raise RuntimeError(f"gloo trainer: {value}")
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def serve(conn: Connection, address: str, checkpoints: list[str], log: str) -> None:
    """The child: output to ``log``, the trainer connected, then one
    ``send_weights()`` per request until ``None``."""
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        trainer, client, sources = _connect(address, checkpoints)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while (request := conn.recv()) is not None:
            checkpoint, version = request
            try:
                trainer.source = sources[checkpoint]
                client.weight_version = version
                trainer.send_weights()
                conn.send(("sent", None))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        trainer.shutdown()
        client.shutdown_weight_transfer_engine()
        client.close()


def _connect(address: str, checkpoints: list[str]) -> tuple[Any, Any, list[Any]]:
    """(the trainer engine, its client, one weight source per checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from engine_server.weight_transfer_gloo import GlooTrainerInitInfo
    from harness.ports import free_port
    from rl_client.weight_sync import ContractWeightSyncClient

    load_general_plugins()  # what a trainer does: the engine server's plugin registers gloo
    sources = [
        ModuleSource(AutoModelForCausalLM.from_pretrained(c, dtype=torch.float32))
        for c in checkpoints
    ]
    client = ContractWeightSyncClient(address, timeout_s=600)
    init = GlooTrainerInitInfo(
        master_address=LOOPBACK, master_port=free_port(), world_size=2, rank=0
    )
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=client, source=sources[0])
    return trainer, client, sources
