"""Safetensors checkpoints for weight updates: read their schema, check an update
against the served model's, and write streamed tensors as a checkpoint.

Engine-neutral (no torch), so that every backend checks updates the same way
and before anything is loaded: in vLLM a tensor with the wrong shape or an
unknown name leaves the engine broken at its next step, so the check must come
first. The format is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data offsets), then the data. Read here rather than
through ``safetensors``: its numpy reader has no bfloat16.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine_server.backends.refit import TensorSpec, WeightUpdateError

# safetensors' dtype names <-> ours (refit.DTYPE_BYTES keys).
SAFETENSORS_DTYPES = {
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_TO_SAFETENSORS = {ours: theirs for theirs, ours in SAFETENSORS_DTYPES.items()}
# As the safetensors library: a larger header is taken for corruption.
_MAX_HEADER_BYTES = 100_000_000

# Checkpoint tensors that engines fuse into one module (vLLM's packed modules:
# qkv_proj, gate_up_proj): an update touching one must bring all of them, or the
# fused module is silently wrong.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _quote(name: str, most: int = 120) -> str:
    """A tensor name as an error message may quote it (never unbounded)."""
    text = repr(name)
    return text if len(text) <= most else f"{text[: most - 12]}... ({len(name)} chars)"


def checkpoint_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    try:
        if not folder.is_dir():
            raise WeightUpdateError(f"checkpoint directory {_quote(str(folder))} does not exist")
        files = sorted(folder.glob("*.safetensors"))
    except OSError as e:  # a name too long, no permission
        raise WeightUpdateError(
            f"checkpoint directory {_quote(str(folder))} cannot be read: {e.strerror}"
        ) from e
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {_quote(str(folder))}")
    return files


def _header(data: bytes | memoryview, file: Path) -> tuple[dict[str, dict[str, object]], int]:
    if len(data) < 8:
        raise WeightUpdateError(f"{file.name}: not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise WeightUpdateError(f"{file.name}: header of {length} bytes does not fit (corrupt)")
    try:
        header = json.loads(bytes(data[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightUpdateError(f"{file.name}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise WeightUpdateError(f"{file.name}: unreadable safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + length


def _spec(name: str, entry: object, file: Path) -> tuple[TensorSpec, int, int]:
    try:
        assert isinstance(entry, dict)
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (int(x) for x in entry["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        raise WeightUpdateError(
            f"{file.name}: tensor {_quote(name)} has an unreadable entry"
        ) from e
    spec = TensorSpec(name, dtype, shape)
    if end - start != spec.nbytes:
        raise WeightUpdateError(f"{file.name}: tensor {_quote(name)} has the wrong size")
    return spec, start, end


def file_schema(file: Path) -> list[TensorSpec]:
    """The tensors of one file, from its header alone; refuses a header or data
    that do not fit in the file (truncated, corrupt)."""
    with file.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise WeightUpdateError(f"{file.name}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise WeightUpdateError(
                f"{file.name}: header of {length} bytes in a file of {size} (corrupt)"
            )
        header, base = _header(head + f.read(length), file)
    specs = []
    for name, entry in header.items():
        spec, _, end = _spec(name, entry, file)
        if base + end > size:
            raise WeightUpdateError(
                f"{file.name}: tensor {_quote(name)} runs past the end of the file (truncated)"
            )
        specs.append(spec)
    return specs


def read_safetensors(file: Path) -> Iterator[tuple[TensorSpec, memoryview]]:
    """Every tensor of one file, as its spec and raw bytes (mapped, not read:
    checkpoints can be larger than memory)."""
    with file.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise WeightUpdateError(f"{file.name}: not a safetensors file (empty)")
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    header, base = _header(data, file)
    for name, entry in header.items():
        spec, start, end = _spec(name, entry, file)
        if base + end > len(data):
            raise WeightUpdateError(
                f"{file.name}: tensor {_quote(name)} runs past the end of the file"
            )
        yield spec, data[base + start : base + end]


def checkpoint_schema(path: str | Path) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint directory, by name (headers only)."""
    schema: dict[str, TensorSpec] = {}
    for file in checkpoint_files(path):
        for spec in file_schema(file):
            schema[spec.name] = spec
    return schema


def check_update(
    model: dict[str, TensorSpec], update: Sequence[TensorSpec], *, allow_partial: bool
) -> None:
    """Refuse an update that does not fit the model, naming the first tensor that
    does not; nothing is loaded by the caller unless this passes."""
    given = {spec.name for spec in update}
    for spec in update:
        known = model.get(spec.name)
        if known is None:
            raise WeightUpdateError(f"tensor {_quote(spec.name)} is not a weight of this model")
        if known.shape != spec.shape:
            raise WeightUpdateError(
                f"tensor {_quote(spec.name)} has shape {list(spec.shape)}; the model's has "
                f"{list(known.shape)}"
            )
        if known.dtype != spec.dtype:
            raise WeightUpdateError(
                f"tensor {_quote(spec.name)} has dtype {spec.dtype}; the model's has {known.dtype}"
            )
    missing = sorted(set(model) - given)
    if not missing:
        return
    if not allow_partial:
        raise WeightUpdateError(
            f"{len(missing)} of the model's {len(model)} tensors are missing "
            f"(e.g. {_quote(missing[0])}); send them all, or set allow_partial"
        )
    for name in sorted(given):
        for group in _FUSED_GROUPS:
            for member in group:
                marker = f".{member}."
                if marker not in name:
                    continue
                needed = [name.replace(marker, f".{other}.") for other in group]
                absent = [n for n in needed if n in model and n not in given]
                if absent:
                    raise WeightUpdateError(
                        f"partial update: {_quote(name)} is fused with {_quote(absent[0])} "
                        "in the engine; "
                        f"send {', '.join(_quote(n) for n in needed if n in model)} together"
                    )


class SafetensorsWriter:
    """Writes streamed tensors, in manifest order, as ``model.safetensors`` in a
    private directory (mode 0700), preferably on tmpfs (``/dev/shm``) when it
    has room: the engine then loads that directory like any checkpoint."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        offsets: dict[str, object] = {}
        position = 0
        for spec in specs:
            offsets[spec.name] = {
                "dtype": _TO_SAFETENSORS[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [position, position + spec.nbytes],
            }
            position += spec.nbytes
        header = json.dumps(offsets, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # data 8-byte aligned, as safetensors writes
        self.total = position
        self.directory = Path(tempfile.mkdtemp(prefix="engine-weights-", dir=_scratch(position)))
        self._file = (self.directory / "model.safetensors").open("xb")
        self._file.write(struct.pack("<Q", len(header)) + header)
        self.written = 0

    def write(self, data: memoryview) -> None:
        self._file.write(data)
        self.written += len(data)

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        self._file.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _scratch(size: int) -> str | None:
    """/dev/shm when it holds the update with room to spare, else the temp dir."""
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * size + (64 << 20):
            return shm
    except OSError:
        pass
    return None
