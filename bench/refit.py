"""Part 6: the refit cycle. Pause -> update weights -> resume, wall time, and the
update's MB/s: the same checkpoint streamed over the contract (TCP and a unix
socket) next to the engine server loading it from disk (the page cache is warm,
as it is for a checkpoint the trainer has just written).

On a synthetic checkpoint of a few hundred MB served by the sim engine (its
load reads and digests every byte, as a real load reads every byte) and on the
tiny model served by vLLM (where installed). The goal: streaming over a unix
socket is not slower than loading from disk (ratio >= 1).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.context import Bench, say
from bench.report import fmt, table
from bench.stats import median
from engine_contract.tensors import Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.checkpoint import SafetensorsWriter
from engine_server.backends.refit import TensorSpec
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import tiny_vllm_args
from harness.env import importable

DISK, TCP, UNIX = "disk", "stream, tcp", "stream, unix"
SYNTHETIC_MB = 256


@dataclass
class Row:
    checkpoint: str
    mb: float
    # path -> per-repetition (cycle seconds, update seconds)
    cycles: dict[str, list[float]] = field(default_factory=dict)
    updates: dict[str, list[float]] = field(default_factory=dict)

    def mbps(self, path: str) -> float:
        return self.mb / median(self.updates[path])


@dataclass
class Refit:
    rows: list[Row]

    def render(self) -> str:
        lines = [
            "## 6. The refit cycle: pause -> update -> resume",
            "",
            "Median wall time of the whole cycle, and of the update alone as MB/s; "
            "the last column is streaming's MB/s over loading from disk.",
            "",
        ]
        out = []
        for row in self.rows:
            for path in row.cycles:
                ratio = "" if path == DISK else f"{row.mbps(path) / row.mbps(DISK):.2f}"
                out.append(
                    [
                        row.checkpoint,
                        fmt(row.mb),
                        path,
                        fmt(median(row.cycles[path]) * 1000),
                        fmt(row.mbps(path)),
                        ratio,
                    ]
                )
        lines += table(
            ["checkpoint", "MB", "weights from", "cycle ms", "update MB/s", "vs disk"],
            "lrlrrr",
            out,
        )
        return "\n".join([*lines, ""])


def synthetic_model(bench: Bench, mb: int, seed: int, folder: str) -> Path:
    """The tiny model's tokenizer and config with a synthetic checkpoint of ``mb``
    MB (float32 tensors of 4 MB): what the sim engine serves and refits."""
    out = bench.root / folder
    out.mkdir()
    for file in bench.model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy2(file, out / file.name)
    rng = np.random.default_rng(seed)
    specs = [TensorSpec(f"layers.{i}.weight", "float32", (1024, 1024)) for i in range(mb // 4)]
    writer = SafetensorsWriter(specs)
    for _ in specs:
        writer.write(memoryview(rng.standard_normal((1024, 1024), dtype=np.float32).tobytes()))
    writer.close()
    shutil.move(writer.directory / "model.safetensors", out / "model.safetensors")
    shutil.rmtree(writer.directory, ignore_errors=True)
    return out


def cycle(
    stub: pb_grpc.EngineServiceStub, version: str, path: Path | None, tensors: list[Tensor] | None
) -> tuple[float, float]:
    """One pause -> update -> resume; (cycle seconds, update seconds)."""
    started = time.perf_counter()
    stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=60)
    t0 = time.perf_counter()
    if tensors is not None:
        stub.UpdateWeightsFromTensors(update_requests(tensors, weight_version=version), timeout=600)
    else:
        options = pb.WeightUpdateOptions(weight_version=version)
        stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(path=str(path), options=options), timeout=600
        )
    update = time.perf_counter() - t0
    stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=60)
    return time.perf_counter() - started, update


def measure(
    bench: Bench,
    name: str,
    servers: dict[str, str],
    checkpoints: tuple[Path, Path],
) -> Row:
    """Alternate A and B (every update changes the weights), paths interleaved."""
    tensors = [checkpoint_tensors(c) for c in checkpoints]
    mb = sum(t.nbytes for t in tensors[0]) / 1e6
    row = Row(name, mb)
    channels = {
        path: grpc.insecure_channel(address, options=_options())
        for path, address in servers.items()
    }
    stubs = {path: pb_grpc.EngineServiceStub(c) for path, c in channels.items()}
    reps = bench.options.reps
    try:
        for rep in range(reps + 1):  # the first is a warm-up
            for path in _rotated(list(servers), rep):
                side = rep % 2
                stub = stubs[DISK if path == DISK else path]
                if path == DISK:
                    result = cycle(stub, f"v{rep}", checkpoints[1 - side], None)
                else:
                    result = cycle(stub, f"v{rep}", None, tensors[1 - side])
                if rep:
                    row.cycles.setdefault(path, []).append(result[0])
                    row.updates.setdefault(path, []).append(result[1])
    finally:
        for channel in channels.values():
            channel.close()
    say(f"  {name}: " + ", ".join(f"{p} {fmt(row.mbps(p))} MB/s" for p in row.updates))
    return row


def _options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]


def _rotated(items: list[str], rep: int) -> list[str]:
    k = rep % len(items)
    return items[k:] + items[:k]


async def run(bench: Bench) -> Refit:
    say("part 6: the refit cycle (pause -> update -> resume)")
    rows = []
    mb = 32 if bench.options.quick else SYNTHETIC_MB
    a = synthetic_model(bench, mb, 0, "synthetic-a")
    b = synthetic_model(bench, mb, 1, "synthetic-b")
    sim = ["--model", str(a), "--max-message-bytes", str(64 << 20)]
    tcp_proc, tcp = bench.group.engine_server("refit-sim-tcp", *sim, timeout=120)
    sock = bench.root / "refit.sock"
    unix_proc, unix = bench.group.engine_server(
        "refit-sim-unix", *sim, listen=f"unix:{sock}", timeout=120
    )
    # Loading from disk and streaming run on the same (TCP) server, in turn.
    rows.append(
        measure(bench, f"synthetic, sim ({mb} MB)", {DISK: tcp, TCP: tcp, UNIX: unix}, (a, b))
    )
    bench.stop(tcp_proc, unix_proc)
    if importable("vllm"):
        args = [
            "--model",
            str(bench.model_dir),
            *tiny_vllm_args(),
            "--max-message-bytes",
            str(64 << 20),
        ]
        proc, address = bench.group.engine_server("refit-vllm", *args, backend="vllm", timeout=300)
        vllm_sock = bench.root / "refit-vllm.sock"
        unix_proc, unix = bench.group.engine_server(
            "refit-vllm-unix", *args, backend="vllm", listen=f"unix:{vllm_sock}", timeout=300
        )
        tiny = (bench.model_dir, tiny_weights_dir(1))
        servers = {DISK: address, TCP: address, UNIX: unix}
        rows.append(measure(bench, "tiny model, vLLM", servers, tiny))
        bench.stop(proc, unix_proc)
    return Refit(rows)
