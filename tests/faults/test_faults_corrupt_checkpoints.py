"""Issue 28: a corrupt checkpoint folder is refused, never "weights unknown".

Random corrupt folders (fixed seed; ``FUZZ_CASES=N`` for more than 50), every
kind in turn, against one sim engine server process on the tiny model over
real gRPC: each update is refused with the problem named and "the old weights
still serve" (INVALID_ARGUMENT, or DEADLINE_EXCEEDED naming the check
deadline), the server stays SERVING and paused, resumes, and a greedy rollout
is bit-exact (tokens, logprobs) to the one taken before, under the same
version. A FIFO is refused by name, well within the check deadline, and
nothing ever blocks on it. Not here: a file root cannot read (tests run as
root, so chmod 000 denies nothing); /proc/self/mem stands in for a file that
cannot be read (EIO).
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir
from harness.engine import greedy_rollout, tokens_and_logprobs
from harness.procs import ProcessGroup

pytestmark = pytest.mark.serial

CASES = int(os.environ.get("FUZZ_CASES", "50"))
SEED = 28
CHECK_TIMEOUT_S = 2.0
SERVICE = "engine_contract.v1.EngineService"
# Same-width dtypes: the entry stays self-consistent, only the model refuses it.
SWAP_DTYPE = {"F32": "I32", "I32": "F32", "BF16": "F16", "F16": "BF16", "F64": "I64"}


@dataclass
class Source:
    """The seed-1 checkpoint of the tiny model (a good update), as tensors."""

    raw: bytes
    tensors: list[tuple[str, dict[str, object], bytes]]

    @classmethod
    def read(cls, file: Path) -> Source:
        raw = file.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header.pop("__metadata__", None)
        body = raw[8 + length :]
        tensors = [
            (name, entry, body[entry["data_offsets"][0] : entry["data_offsets"][1]])
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
        ]
        return cls(raw, tensors)


def pack(header: object, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def layout(
    tensors: list[tuple[str, dict[str, object], bytes]], gaps: dict[int, int] | None = None
) -> tuple[dict[str, dict[str, object]], bytes]:
    """A header and body laying ``tensors`` out in order (``gaps``: bytes left
    before tensor i)."""
    header: dict[str, dict[str, object]] = {}
    body = b""
    for i, (name, entry, blob) in enumerate(tensors):
        body += b"\0" * (gaps or {}).get(i, 0)
        header[name] = {**entry, "data_offsets": [len(body), len(body) + len(blob)]}
        body += blob
    return header, body


# A kind writes its corrupt entries into a folder and says (a regex) what the
# refusal must name.
Kind = Callable[[random.Random, Path, Source], str]


def write(folder: Path, data: bytes, name: str = "x.safetensors") -> None:
    (folder / name).write_bytes(data)


def some(rng: random.Random, source: Source) -> int:
    return rng.randrange(len(source.tensors))


def with_entry(source: Source, index: int, **changes: object) -> bytes:
    header, body = layout(source.tensors)
    name = source.tensors[index][0]
    header[name] = {**header[name], **changes}
    return pack(header, body)


def directory(rng: random.Random, folder: Path, source: Source) -> str:
    (folder / "x.safetensors").mkdir()
    return "'x.safetensors' is a directory"


def dangling(rng: random.Random, folder: Path, source: Source) -> str:
    (folder / "x.safetensors").symlink_to(folder / f"gone-{rng.random()}")
    return "'x.safetensors' is a dangling symlink"


def fifo(rng: random.Random, folder: Path, source: Source) -> str:
    os.mkfifo(folder / "x.safetensors")
    return "'x.safetensors' is a FIFO"


def nested(rng: random.Random, folder: Path, source: Source) -> str:
    header = b"[" * rng.randint(100_000, 300_000)
    write(folder, struct.pack("<Q", len(header)) + header)
    return "nested too deep"


def truncated(rng: random.Random, folder: Path, source: Source) -> str:
    write(folder, source.raw[: rng.randrange(len(source.raw))])
    return "too short|corrupt|truncated|unreadable safetensors header"


def length_past_end(rng: random.Random, folder: Path, source: Source) -> str:
    rest = source.raw[8:]
    write(folder, struct.pack("<Q", len(rest) + rng.randint(1, 1 << 40)) + rest)
    return r"header of \d+ bytes in a file of \d+ \(corrupt\)"


def not_json(rng: random.Random, folder: Path, source: Source) -> str:
    text = "{" + "".join(rng.choice('abc:,[]" ') for _ in range(rng.randint(1, 64)))
    write(folder, struct.pack("<Q", len(text)) + text.encode())
    return "unreadable safetensors header"


def json_not_object(rng: random.Random, folder: Path, source: Source) -> str:
    write(folder, pack(rng.choice([[1, 2], "x", 3, None, True, []]), b""))
    return "unreadable safetensors header"


def wrong_dtype(rng: random.Random, folder: Path, source: Source) -> str:
    index = some(rng, source)
    dtype = SWAP_DTYPE[str(source.tensors[index][1]["dtype"])]
    write(folder, with_entry(source, index, dtype=dtype))
    return "has dtype"


def unknown_dtype(rng: random.Random, folder: Path, source: Source) -> str:
    index = some(rng, source)
    write(folder, with_entry(source, index, dtype=rng.choice(["F7", "f32", "", "Q4"])))
    return "has an unreadable entry"


def wrong_shape(rng: random.Random, folder: Path, source: Source) -> str:
    index = some(rng, source)
    shape = list(source.tensors[index][1]["shape"])  # type: ignore[call-overload]
    write(
        folder, with_entry(source, index, shape=[1, *shape] if rng.random() < 0.5 else [*shape, 1])
    )
    return "has shape"


def unknown_name(rng: random.Random, folder: Path, source: Source) -> str:
    tensors = list(source.tensors)
    index = some(rng, source)
    _, entry, blob = tensors[index]
    tensors[index] = (f"model.layers.{rng.randint(50, 99)}.fuzz.weight", entry, blob)
    write(folder, pack(*layout(tensors)))
    return "is not a weight of this model"


def missing(rng: random.Random, folder: Path, source: Source) -> str:
    tensors = list(source.tensors)
    for _ in range(rng.randint(1, len(tensors) - 1)):
        tensors.pop(rng.randrange(len(tensors)))
    write(folder, pack(*layout(tensors)))
    return "tensors are missing"


def overlapping(rng: random.Random, folder: Path, source: Source) -> str:
    header, body = layout(source.tensors)
    entries = list(header.values())
    if rng.random() < 0.5:  # every tensor at the start, as the issue found
        for entry in entries:
            start, end = entry["data_offsets"]  # type: ignore[misc]
            entry["data_offsets"] = [0, end - start]
    else:  # the last one moved back into the one before
        shift = rng.randint(1, 16)
        start, end = entries[-1]["data_offsets"]  # type: ignore[misc]
        entries[-1]["data_offsets"] = [start - shift, end - shift]
    write(folder, pack(header, body))
    return "overlap"


def holes(rng: random.Random, folder: Path, source: Source) -> str:
    gap = rng.randint(1, 64)
    write(folder, pack(*layout(source.tensors, {rng.randrange(len(source.tensors)): gap})))
    return f"{gap} bytes .* belong to no tensor"


def trailing(rng: random.Random, folder: Path, source: Source) -> str:
    extra = rng.randint(1, 4096)
    write(folder, source.raw + rng.randbytes(extra))
    return f"{extra} bytes after the last tensor"


def negative(rng: random.Random, folder: Path, source: Source) -> str:
    index = some(rng, source)
    size = len(source.tensors[index][2])
    write(folder, with_entry(source, index, data_offsets=[-size, 0]))
    return "negative offset"


def huge(rng: random.Random, folder: Path, source: Source) -> str:
    index = some(rng, source)
    size = len(source.tensors[index][2])
    start = rng.choice([1 << 40, 1 << 62, (1 << 64) - size])
    write(folder, with_entry(source, index, data_offsets=[start, start + size]))
    return "runs past the end"


def empty(rng: random.Random, folder: Path, source: Source) -> str:
    write(folder, b"")
    return "too short"


def zero_header(rng: random.Random, folder: Path, source: Source) -> str:
    write(folder, struct.pack("<Q", 0) + rng.randbytes(rng.randint(0, 64)))
    return "unreadable safetensors header"


def not_utf8(rng: random.Random, folder: Path, source: Source) -> str:
    header = b'{"' + bytes([rng.randint(0x80, 0xFF)]) + b'": 1}'
    write(folder, struct.pack("<Q", len(header)) + header)
    return "unreadable safetensors header"


def unreadable(rng: random.Random, folder: Path, source: Source) -> str:
    # Root reads any mode; the server's own /proc/self/mem at offset 0 fails (EIO).
    (folder / "x.safetensors").symlink_to("/proc/self/mem")
    return "cannot be read"


FILE_KINDS: dict[str, Kind] = {
    "directory": directory,
    "dangling symlink": dangling,
    "FIFO": fifo,
    "nested header": nested,
    "truncated": truncated,
    "header length past the end": length_past_end,
    "non-JSON header": not_json,
    "JSON non-object header": json_not_object,
    "wrong dtype": wrong_dtype,
    "unknown dtype": unknown_dtype,
    "wrong shape": wrong_shape,
    "unknown tensor name": unknown_name,
    "overlapping offsets": overlapping,
    "holes": holes,
    "trailing bytes": trailing,
    "negative offset": negative,
    "huge offset": huge,
    "empty file": empty,
    "zero-length header": zero_header,
    "non-UTF-8 header": not_utf8,
    "unreadable file": unreadable,
}


def mix(rng: random.Random, folder: Path, source: Source) -> str:
    """The good checkpoint whole, next to a bad file: nothing of it may load."""
    write(folder, source.raw, "a.safetensors")
    kind = rng.choice(sorted(FILE_KINDS))
    return FILE_KINDS[kind](rng, folder, source)


KINDS: dict[str, Kind] = {**FILE_KINDS, "missing tensors": missing, "good file and a bad one": mix}


def cases(count: int) -> Iterator[tuple[int, str]]:
    """Every kind in turn (in an order the seed shuffles), ``count`` in all."""
    rng = random.Random(SEED)
    names = sorted(KINDS)
    rng.shuffle(names)
    for i in range(count):
        yield i, names[i % len(names)]


def greedy(stub: pb_grpc.EngineServiceStub) -> tuple[list[int], list[float]]:
    return tokens_and_logprobs(greedy_rollout(stub, [5, 17, 42, 8, 99, 3], 12, timeout=30))


def test_corrupt_checkpoints_are_refused_and_the_old_weights_keep_serving(
    tmp_path: Path, model_dir: Path
) -> None:
    source = Source.read(tiny_weights_dir(1) / "model.safetensors")
    rng = random.Random(SEED)
    with ProcessGroup(tmp_path / "logs") as group:
        proc, address = group.engine_server(
            "engine",
            "--model",
            str(model_dir),
            "--eos-rate",
            "0",
            "--decode-step-ms",
            "0",
            "--refit-check-timeout-s",
            str(CHECK_TIMEOUT_S),
        )
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            before = greedy(stub)
            version = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10)
            seen: dict[str, int] = {}
            for i, kind in cases(CASES):
                folder = tmp_path / f"case-{i}"
                folder.mkdir()
                needle = KINDS[kind](rng, folder, source)
                what = f"case {i} ({kind}): {needle}"
                stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    stub.UpdateWeightsFromPath(
                        pb.UpdateWeightsFromPathRequest(
                            path=str(folder), options=pb.WeightUpdateOptions(weight_version="fuzz")
                        ),
                        timeout=CHECK_TIMEOUT_S + 10,
                    )
                error: grpc.Call = refused.value  # type: ignore[assignment]
                details = error.details() or ""
                assert error.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ), f"{what}: {error.code()} {details}\n{proc.log_tail()}"
                assert re.search(needle, details), f"{what}: {details}"
                assert "the old weights still serve" in details, f"{what}: {details}"
                assert time.monotonic() - started < CHECK_TIMEOUT_S + 5, what
                check = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING, what
                assert stub.IsPaused(pb.IsPausedRequest(), timeout=10).paused, what
                stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
                assert stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10) == version
                assert greedy(stub) == before, what
                seen[kind] = seen.get(kind, 0) + 1
            assert proc.alive()
    print(f"\n[fuzz] {CASES} corrupt checkpoints refused: {json.dumps(seen, sort_keys=True)}")
    if CASES >= len(KINDS):
        assert set(seen) == set(KINDS)


def test_a_fifo_is_refused_within_the_check_deadline_and_rollouts_go_on(
    tmp_path: Path, model_dir: Path
) -> None:
    """The issue's hang: before, UpdateWeightsFromPath on a FIFO never returned and
    ResumeGeneration waited on the refit lock for good."""
    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / "x.safetensors")
    with ProcessGroup(tmp_path / "logs") as group:
        _, address = group.engine_server(
            "engine", "--model", str(model_dir), "--eos-rate", "0", "--refit-check-timeout-s", "1"
        )
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            before = greedy(stub)
            stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                stub.UpdateWeightsFromPath(
                    pb.UpdateWeightsFromPathRequest(path=str(folder)), timeout=30
                )
            assert time.monotonic() - started < 1.0
            error: grpc.Call = refused.value  # type: ignore[assignment]
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert "is a FIFO" in (error.details() or "")
            assert stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=5).resumed
            assert greedy(stub) == before
