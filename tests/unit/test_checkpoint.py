"""Checkpoint files for weight updates: the schema read from headers, the checks an
update must pass before anything loads, and streamed tensors written back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from engine_server.backends.checkpoint import (
    SafetensorsWriter,
    check_update,
    checkpoint_schema,
    file_schema,
    read_safetensors,
)
from engine_server.backends.refit import TensorSpec, WeightUpdateError

MODEL = {
    s.name: s
    for s in [
        TensorSpec("model.layers.0.self_attn.q_proj.weight", "float32", (4, 4)),
        TensorSpec("model.layers.0.self_attn.k_proj.weight", "float32", (4, 4)),
        TensorSpec("model.layers.0.self_attn.v_proj.weight", "float32", (4, 4)),
        TensorSpec("model.layers.0.mlp.gate_proj.weight", "float32", (8, 4)),
        TensorSpec("model.layers.0.mlp.up_proj.weight", "float32", (8, 4)),
        TensorSpec("lm_head.weight", "float32", (16, 4)),
    ]
}


def test_a_streamed_checkpoint_reads_back_byte_for_byte(tmp_path: Path) -> None:
    specs = list(MODEL.values())
    writer = SafetensorsWriter(specs)
    blobs = [bytes([i]) * s.nbytes for i, s in enumerate(specs)]
    for blob in blobs:
        writer.write(memoryview(blob))
    writer.close()
    file = writer.directory / "model.safetensors"
    assert file_schema(file) == specs
    assert checkpoint_schema(writer.directory) == MODEL
    assert [bytes(data) for _, data in read_safetensors(file)] == blobs
    safetensors = pytest.importorskip("safetensors")  # the real reader agrees
    with safetensors.safe_open(str(file), "numpy") as f:
        assert sorted(f.keys()) == sorted(MODEL)
    writer.remove()
    assert not writer.directory.exists()


@pytest.mark.parametrize(
    ("update", "allow_partial", "needle"),
    [
        ([TensorSpec("model.layers.9.x.weight", "float32", (4, 4))], True, "not a weight"),
        ([TensorSpec("lm_head.weight", "float32", (32, 4))], True, "has shape [32, 4]"),
        ([TensorSpec("lm_head.weight", "bfloat16", (16, 4))], True, "has dtype bfloat16"),
        ([MODEL["lm_head.weight"]], False, "5 of the model's 6 tensors are missing"),
        ([MODEL["model.layers.0.self_attn.q_proj.weight"]], True, "k_proj"),
        ([MODEL["model.layers.0.mlp.up_proj.weight"]], True, "gate_proj"),
    ],
)
def test_updates_that_do_not_fit_are_refused(
    update: list[TensorSpec], allow_partial: bool, needle: str
) -> None:
    with pytest.raises(WeightUpdateError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        check_update(MODEL, update, allow_partial=allow_partial)


def test_updates_that_fit_pass() -> None:
    check_update(MODEL, list(MODEL.values()), allow_partial=False)
    fused = [MODEL[n] for n in MODEL if "self_attn" in n]
    check_update(MODEL, fused, allow_partial=True)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<Q", 1 << 62) + b"{}",  # a header longer than the file
        struct.pack("<Q", (1 << 63) + 5) + b"{}",  # past int64
        b"\x05\x00",  # shorter than the length itself
        struct.pack("<Q", 8) + b"not json",
    ],
)
def test_corrupt_files_are_refused_not_crashed_on(tmp_path: Path, data: bytes) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(data)
    with pytest.raises(WeightUpdateError):
        file_schema(file)
    with pytest.raises(WeightUpdateError):
        list(read_safetensors(file))


def test_a_truncated_file_is_refused_from_its_header(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)  # 8 of 16 bytes
    with pytest.raises(WeightUpdateError, match="truncated"):
        file_schema(file)


def test_a_missing_or_unreadable_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightUpdateError, match="does not exist"):
        checkpoint_schema(tmp_path / "nowhere")
    with pytest.raises(WeightUpdateError, match="cannot be read"):
        checkpoint_schema(tmp_path / ("x" * 300))  # a name too long


def test_the_contract_knows_every_dtype_s_size() -> None:
    from engine_contract.tensors import TENSOR_DTYPE_BYTES, TENSOR_DTYPES

    assert set(TENSOR_DTYPE_BYTES) == set(TENSOR_DTYPES)
