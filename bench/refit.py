"""Part 6: the refit cycle. Pause -> update weights -> resume, wall time, and the
update's MB/s: the same checkpoint streamed over the contract (TCP and a unix
socket) and sent by a trainer over vLLM's weight-transfer protocol (``gloo``),
next to the engine server loading it from disk (the page cache is warm, as it is
for a checkpoint the trainer has just written).

Rows: a synthetic checkpoint of a few hundred MB served by the sim engine (its
load reads and digests every byte, as a real load reads every byte); where vLLM
is installed, the tiny model and a synthetic Llama of about 300 MB
(``refit_checkpoints.LLAMA_300MB``) served by vLLM with ``--weight-transfer-config
'{"backend": "gloo"}'``, the trainer (``bench/gloo_trainer.py``) a child process
driving the engine server through ``ContractWeightSyncClient``. Each update
loads the other of two checkpoints, so every update changes the weights.

Goals (issue 30): the gloo path is not slower than loading the same checkpoint
from disk (MB/s ratio >= 1), on each vLLM row.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.context import Bench, say
from bench.gloo_trainer import GlooTrainer
from bench.refit_checkpoints import (
    LLAMA_300MB,
    LLAMA_QUICK,
    synthetic_llama,
    synthetic_model,
)
from bench.report import Goal, fmt, goal_table, table
from bench.stats import median, rotate
from engine_contract.tensors import Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.checkpoint import checkpoint_schema
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import tiny_vllm_args, weight_transfer_args
from harness.env import importable

DISK, TCP, UNIX, GLOO = "disk", "stream, tcp", "stream, unix", "gloo"
SYNTHETIC_MB = 256
# Issue 30: gloo's MB/s over loading the same checkpoint from disk.
GOAL_GLOO_OVER_DISK = 1.0
MAX_MESSAGE = 64 << 20
GLOO_CONFIG = weight_transfer_args("gloo")

# One update of a server's weights to checkpoint 0 or 1, labelled with a version.
Update = Callable[[int, str], None]


@dataclass
class Row:
    checkpoint: str
    mb: float
    # path -> per-repetition (cycle seconds, update seconds)
    cycles: dict[str, list[float]] = field(default_factory=dict)
    updates: dict[str, list[float]] = field(default_factory=dict)

    def mbps(self, path: str) -> float:
        return self.mb / median(self.updates.get(path, []))

    def over_disk(self, path: str) -> float:
        return self.mbps(path) / self.mbps(DISK)


@dataclass
class Refit:
    rows: list[Row]

    def goals(self) -> list[Goal]:
        return [
            Goal.at_least(
                f"gloo MB/s over disk's, {row.checkpoint}", row.over_disk(GLOO), GOAL_GLOO_OVER_DISK
            )
            for row in self.rows
            if GLOO in row.updates
        ]

    def render(self) -> str:
        lines = [
            "## 6. The refit cycle: pause -> update -> resume",
            "",
            "Median wall time of the whole cycle, and of the update alone as MB/s; "
            "the last column is each path's MB/s over loading the same checkpoint "
            "from disk. gloo: vLLM's trainer-side weight-transfer engine in another "
            "process, send_weights() (start, update while it broadcasts, finish).",
            "",
        ]
        out = []
        for row in self.rows:
            for path in row.cycles:
                out.append(
                    [
                        row.checkpoint,
                        fmt(row.mb),
                        path,
                        fmt(median(row.cycles[path]) * 1000),
                        fmt(row.mbps(path)),
                        "" if path == DISK else f"{row.over_disk(path):.2f}",
                    ]
                )
        lines += table(
            ["checkpoint", "MB", "weights from", "cycle ms", "update MB/s", "vs disk"],
            "lrlrrr",
            out,
        )
        if goals := self.goals():
            lines += ["", "Goals (issue 30):", "", *goal_table(goals)]
        return "\n".join([*lines, ""])


def cycle(
    stub: pb_grpc.EngineServiceStub, update: Update, checkpoint: int, version: str
) -> tuple[float, float]:
    """One pause -> update -> resume; (cycle seconds, update seconds)."""
    started = time.perf_counter()
    stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=60)
    t0 = time.perf_counter()
    update(checkpoint, version)
    took = time.perf_counter() - t0
    stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=60)
    return time.perf_counter() - started, took


def from_disk(stub: pb_grpc.EngineServiceStub, checkpoints: Sequence[Path]) -> Update:
    def update(checkpoint: int, version: str) -> None:
        request = pb.UpdateWeightsFromPathRequest(
            path=str(checkpoints[checkpoint]),
            options=pb.WeightUpdateOptions(weight_version=version),
        )
        stub.UpdateWeightsFromPath(request, timeout=600)

    return update


def streamed(stub: pb_grpc.EngineServiceStub, tensors: Sequence[list[Tensor]]) -> Update:
    def update(checkpoint: int, version: str) -> None:
        requests = update_requests(tensors[checkpoint], weight_version=version)
        stub.UpdateWeightsFromTensors(requests, timeout=600)

    return update


@contextlib.contextmanager
def stubs(addresses: Sequence[str]) -> Iterator[dict[str, pb_grpc.EngineServiceStub]]:
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
    ]
    with contextlib.ExitStack() as stack:
        channels = {a: stack.enter_context(grpc.insecure_channel(a, options)) for a in addresses}
        yield {a: pb_grpc.EngineServiceStub(c) for a, c in channels.items()}


def measure(
    bench: Bench,
    name: str,
    checkpoints: Sequence[Path],
    paths: dict[str, tuple[str, Callable[[pb_grpc.EngineServiceStub], Update]]],
) -> Row:
    """Every path once per repetition, in a rotating order (the first repetition a
    warm-up); each update loads the checkpoint its server does not serve.
    ``paths``: name -> (server address, the update given that server's stub)."""
    row = Row(name, sum(s.nbytes for s in checkpoint_schema(checkpoints[0]).values()) / 1e6)
    serving = {address: 0 for address, _ in paths.values()}  # each starts on checkpoint 0
    with stubs(list(serving)) as by_address:
        updates = {p: make(by_address[a]) for p, (a, make) in paths.items()}
        for rep in range(bench.options.reps + 1):
            for path in rotate(list(paths), rep):
                address = paths[path][0]
                serving[address] = 1 - serving[address]
                result = cycle(by_address[address], updates[path], serving[address], f"v{rep}")
                if rep:
                    row.cycles.setdefault(path, []).append(result[0])
                    row.updates.setdefault(path, []).append(result[1])
    say(f"  {name}: " + ", ".join(f"{p} {fmt(row.mbps(p))} MB/s" for p in row.updates))
    return row


def _sim_row(bench: Bench) -> Row:
    mb = 32 if bench.options.quick else SYNTHETIC_MB
    a = synthetic_model(bench.model_dir, bench.root / "synthetic-a", mb, 0)
    b = synthetic_model(bench.model_dir, bench.root / "synthetic-b", mb, 1)
    sim = ["--model", str(a), "--max-message-bytes", str(MAX_MESSAGE)]
    tcp_proc, tcp = bench.group.engine_server("refit-sim-tcp", *sim, timeout=120)
    sock = bench.root / "refit.sock"
    unix_proc, unix = bench.group.engine_server(
        "refit-sim-unix", *sim, listen=f"unix:{sock}", timeout=120
    )
    try:
        tensors = [checkpoint_tensors(a), checkpoint_tensors(b)]
        # Loading from disk and streaming run on the same (TCP) server, in turn.
        return measure(
            bench,
            f"synthetic, sim ({mb} MB)",
            (a, b),
            {
                DISK: (tcp, lambda stub: from_disk(stub, (a, b))),
                TCP: (tcp, lambda stub: streamed(stub, tensors)),
                UNIX: (unix, lambda stub: streamed(stub, tensors)),
            },
        )
    finally:
        bench.stop(tcp_proc, unix_proc)


def _vllm_row(bench: Bench, name: str, checkpoints: tuple[Path, Path], streams: bool) -> Row:
    """vLLM serving ``checkpoints[0]`` with the gloo backend: disk and gloo on that
    server, and (``streams``) streamed over TCP to it and over a unix socket to a
    second server."""
    args = ["--model", str(checkpoints[0]), *tiny_vllm_args(), "--max-message-bytes"]
    args.append(str(MAX_MESSAGE))
    slug = name.split(",")[0].replace(" ", "-")
    procs = []
    try:
        proc, address = bench.group.engine_server(
            f"refit-vllm-{slug}", *args, *GLOO_CONFIG, backend="vllm", timeout=300
        )
        procs.append(proc)
        paths = {DISK: (address, lambda stub: from_disk(stub, checkpoints))}
        if streams:
            sock = bench.root / f"refit-vllm-{slug}.sock"
            unix_proc, unix = bench.group.engine_server(
                f"refit-vllm-{slug}-unix", *args, backend="vllm", listen=f"unix:{sock}", timeout=300
            )
            procs.append(unix_proc)
            tensors = [checkpoint_tensors(c) for c in checkpoints]
            paths[TCP] = (address, lambda stub: streamed(stub, tensors))
            paths[UNIX] = (unix, lambda stub: streamed(stub, tensors))
        log = bench.group.log_dir / f"gloo-trainer-{slug}.log"
        trainer = GlooTrainer(address, checkpoints, log)
        try:
            paths[GLOO] = (address, lambda _: trainer.send)
            return measure(bench, name, checkpoints, paths)
        finally:
            trainer.close()
    finally:
        bench.stop(*procs)


async def run(bench: Bench) -> Refit:
    say("part 6: the refit cycle (pause -> update -> resume)")
    rows = [_sim_row(bench)]
    if importable("vllm"):
        tiny = (bench.model_dir, tiny_weights_dir(1))
        rows.append(_vllm_row(bench, "tiny model, vLLM", tiny, streams=True))
        shape = LLAMA_QUICK if bench.options.quick else LLAMA_300MB
        a, b = (
            synthetic_llama(bench.model_dir, bench.root / f"llama-{seed}", shape, seed)
            for seed in (0, 1)
        )
        rows.append(
            _vllm_row(bench, f"synthetic Llama, vLLM ({shape.mb:.0f} MB)", (a, b), streams=False)
        )
    return Refit(rows)
