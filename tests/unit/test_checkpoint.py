"""Checkpoint files for weight updates: the schema read from headers, the checks an
update must pass before anything loads, and streamed tensors written back."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import pytest

from engine_server.backends.checkpoint import (
    SafetensorsWriter,
    check_update,
    checkpoint_files,
    checkpoint_schema,
    file_schema,
    read_safetensors,
)
from engine_server.backends.refit import TensorSpec, WeightUpdateError
from harness.checkpoints import unreadable_entry

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


# -- issue 28: entries that are not checkpoint files, and layouts the format forbids


def _file(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _entry(start: int, end: int, shape: tuple[int, ...] = (4,)) -> dict[str, object]:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [start, end]}


@pytest.mark.timeout(10)  # opening a FIFO would block: it must never be opened
@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("directory", "is a directory"),
        ("dangling symlink", "is a dangling symlink"),
        ("FIFO", "is a FIFO"),
        ("socket", "is a socket"),
    ],
)
def test_entries_that_are_not_regular_files_are_refused_by_name(kind: str, needle: str) -> None:
    # A short folder: a unix socket's path is limited to 107 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        folder = Path(tmp)
        unreadable_entry(folder, kind)
        with pytest.raises(WeightUpdateError, match=re.escape(f"'x.safetensors' {needle}")):
            checkpoint_files(folder)
        with pytest.raises(WeightUpdateError, match=re.escape(f"'x.safetensors' {needle}")):
            checkpoint_schema(folder)


@pytest.mark.timeout(10)
def test_a_fifo_swapped_in_after_the_listing_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = unreadable_entry(tmp_path, "FIFO")
    with pytest.raises(WeightUpdateError, match="is a FIFO"):
        file_schema(fifo)
    with pytest.raises(WeightUpdateError, match="is a FIFO"):
        list(read_safetensors(fifo))


def test_a_header_nested_past_the_recursion_limit_is_refused(tmp_path: Path) -> None:
    header = b"[" * 200_000
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(WeightUpdateError, match="nested too deep"):
        file_schema(file)
    with pytest.raises(WeightUpdateError, match="nested too deep"):
        list(read_safetensors(file))


@pytest.mark.parametrize(
    ("header", "data", "needle"),
    [
        ({"a": _entry(0, 16), "b": _entry(0, 16)}, bytes(16), "'a' and 'b' overlap"),
        ({"a": _entry(0, 16), "b": _entry(8, 24)}, bytes(24), "'a' and 'b' overlap"),
        ({"a": _entry(0, 16), "b": _entry(24, 40)}, bytes(40), "8 bytes after 'a'"),
        ({"a": _entry(8, 24)}, bytes(24), "8 bytes at the start"),
        ({"a": _entry(0, 16)}, bytes(20), "4 bytes after the last tensor"),
        ({"a": _entry(-16, 0)}, bytes(16), "negative offset -16"),
        ({"a": _entry(0, 1 << 62, (1 << 60,))}, bytes(16), "runs past the end"),
        ({"a": {**_entry(0, 16), "shape": [-4, -1]}}, bytes(16), "negative dimension"),
    ],
)
def test_layouts_the_format_forbids_are_refused_naming_the_tensors(
    tmp_path: Path, header: dict[str, object], data: bytes, needle: str
) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(_file(header, data))
    with pytest.raises(WeightUpdateError, match=needle):
        file_schema(file)
    with pytest.raises(WeightUpdateError, match=needle):
        list(read_safetensors(file))


def test_empty_tensors_and_every_checkpoint_this_repo_writes_pass(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(
        _file({"e": _entry(0, 0, (0,)), "a": _entry(0, 16), "z": _entry(16, 16, (0,))}, bytes(16))
    )
    assert [s.name for s in file_schema(file)] == ["e", "a", "z"]
    from harness.checkpoints import tiny_weights_dir
    from harness.tiny_model import tiny_model_dir

    for folder in (tiny_model_dir(), tiny_weights_dir(1)):
        schema = checkpoint_schema(folder)
        assert len(schema) > 1
        for part in checkpoint_files(folder):
            assert len(list(read_safetensors(part))) == len(file_schema(part))


def test_a_file_that_cannot_be_read_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(_file({"a": _entry(0, 16)}, bytes(16)))
    real_open = os.open

    def failing_open(path: object, *args: object, **kwargs: object) -> int:
        if Path(str(path)) == file:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(
        WeightUpdateError, match=re.escape("'model.safetensors' cannot be read: Input/output")
    ):
        file_schema(file)
    with pytest.raises(WeightUpdateError, match=re.escape("'model.safetensors' cannot be read")):
        list(read_safetensors(file))
