"""Safetensors checkpoints for weight updates: read their schema, check an update
against the served model's, check a folder before anything loads from it (resolved,
held to the allowed folders, every header read: ``preflight``), and write streamed
tensors as a checkpoint.

Engine-neutral (no torch), so that every backend checks updates the same way
and before anything is loaded: in vLLM a tensor with the wrong shape or an
unknown name leaves the engine broken at its next step, so the check must come
first. The format is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data offsets), then the data. Read here rather than
through ``safetensors``: its numpy reader has no bfloat16.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import stat
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from engine_contract.text import clip
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
    """The folder's ``*.safetensors`` entries, each a regular file (symlinks
    followed): a directory, a FIFO (opening one blocks), a socket, a device or a
    dangling symlink is refused by name, before anything is opened."""
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
    for file in files:
        try:
            mode = file.stat().st_mode
        except OSError as e:
            problem = "a dangling symlink" if file.is_symlink() else "unreadable"
            raise WeightUpdateError(
                f"{_quote(file.name)} is {problem} ({e.strerror}); not a checkpoint file"
            ) from e
        _require_regular(mode, file)
    return files


# What a folder entry is when it is not a regular file, for the refusal.
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _require_regular(mode: int, file: Path) -> None:
    if not stat.S_ISREG(mode):
        raise WeightUpdateError(
            f"{_quote(file.name)} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, "
            "not a checkpoint file"
        )


@contextlib.contextmanager
def _unreadable_as_refusal(file: Path) -> Iterator[None]:
    """What reading a file can raise beyond a corrupt header (an I/O error, a
    header nested past the parser's recursion limit, one too large for memory)
    as a refusal naming the file: nothing was loaded yet."""
    try:
        yield
    except OSError as e:
        raise WeightUpdateError(f"{_quote(file.name)} cannot be read: {e.strerror or e}") from e
    except RecursionError as e:
        raise WeightUpdateError(
            f"{_quote(file.name)}: safetensors header nested too deep to read (corrupt)"
        ) from e
    except MemoryError as e:
        raise WeightUpdateError(
            f"{_quote(file.name)}: safetensors header too large to read into memory"
        ) from e


def _open_regular(file: Path) -> BinaryIO:
    """``file`` opened for reading, refused unless it is a regular file. Opened
    non-blocking, so that a FIFO put in its place after ``checkpoint_files``
    looked is refused, not waited on."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(os.fstat(fd).st_mode, file)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


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
    except (AssertionError, KeyError, TypeError, ValueError, OverflowError) as e:
        raise WeightUpdateError(
            f"{file.name}: tensor {_quote(name)} has an unreadable entry"
        ) from e
    if any(d < 0 for d in shape):
        raise WeightUpdateError(
            f"{file.name}: tensor {_quote(name)} has a negative dimension in {list(shape)}"
        )
    if start < 0:
        raise WeightUpdateError(
            f"{file.name}: tensor {_quote(name)} has a negative offset {start} (corrupt)"
        )
    spec = TensorSpec(name, dtype, shape)
    if end - start != spec.nbytes:
        raise WeightUpdateError(f"{file.name}: tensor {_quote(name)} has the wrong size")
    return spec, start, end


def _tensors(
    header: dict[str, dict[str, object]], data_bytes: int, file: Path
) -> list[tuple[TensorSpec, int, int]]:
    """The header's tensors with their offsets, refused unless they index the data
    exactly as the format demands ("entirely indexed, and cannot contain holes"):
    no overlap, no gap, nothing past the end and nothing after the last tensor."""
    tensors = [_spec(name, entry, file) for name, entry in header.items()]
    for spec, _, end in tensors:
        if end > data_bytes:
            raise WeightUpdateError(
                f"{file.name}: tensor {_quote(spec.name)} runs past the end of the file (truncated)"
            )
    position, previous = 0, None
    for spec, start, end in sorted(tensors, key=lambda t: (t[1], t[2])):
        if start < position:
            raise WeightUpdateError(
                f"{file.name}: tensors {_quote(previous or '')} and {_quote(spec.name)} "
                "overlap (corrupt)"
            )
        if start > position:
            after = f"after {_quote(previous)}" if previous else "at the start"
            raise WeightUpdateError(
                f"{file.name}: {start - position} bytes {after} belong to no tensor "
                f"(a hole before {_quote(spec.name)}; corrupt)"
            )
        position, previous = end, spec.name
    if position != data_bytes:
        raise WeightUpdateError(
            f"{file.name}: {data_bytes - position} bytes after the last tensor belong to "
            "no tensor (corrupt)"
        )
    return tensors


def file_schema(file: Path) -> list[TensorSpec]:
    """The tensors of one file, from its header alone; refuses a header or data
    that do not fit in the file (truncated, corrupt) and a file that cannot be
    read, naming it."""
    with _unreadable_as_refusal(file), _open_regular(file) as f:
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
        return [spec for spec, _, _ in _tensors(header, size - base, file)]


def read_safetensors(file: Path) -> Iterator[tuple[TensorSpec, memoryview]]:
    """Every tensor of one file, as its spec and raw bytes (mapped, not read:
    checkpoints can be larger than memory). The header is checked whole before
    the first tensor is yielded."""
    with _unreadable_as_refusal(file):
        with _open_regular(file) as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise WeightUpdateError(f"{file.name}: not a safetensors file (empty)")
            data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        header, base = _header(data, file)
        tensors = _tensors(header, len(data) - base, file)
    for spec, start, end in tensors:
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


class FolderNotAllowed(Exception):
    """A weight update's folder resolves outside the folders updates may load from
    (the caller lacks the right; the request is well formed)."""


def preflight(path: str, allowed: tuple[Path, ...]) -> str:
    """The path resolved (symlinks, ``..``), held to the allowed folders, and every
    file's header read: whatever is wrong is found before anything loads, and the
    path checked is the path the backend is given. Blocking: run off the loop."""
    try:
        resolved = os.path.realpath(path)
        if allowed:
            _check_allowed(path, resolved, allowed)
        checkpoint_schema(resolved)
    except (WeightUpdateError, FolderNotAllowed):
        raise
    except Exception as e:  # nothing loaded whatever it is: still a refusal
        raise WeightUpdateError(f"the checkpoint could not be checked: {clip(e, 300)}") from e
    return resolved


PATH_SHOWN = 300


def _check_allowed(path: str, resolved: str, allowed: tuple[Path, ...]) -> None:
    roots = [os.path.realpath(folder) for folder in allowed]
    if any(os.path.commonpath([root, resolved]) == root for root in roots):
        return
    # Folders are quoted up to PATH_SHOWN characters: a checkpoint folder's path is
    # often longer than a clipped value's 80, and the operator needs all of it.
    raise FolderNotAllowed(
        f"path: {clip(path, PATH_SHOWN)} resolves to {clip(resolved, PATH_SHOWN)}, outside the "
        "folders weight updates may load from (--weights-allowed-dir "
        f"{', '.join(clip(r, PATH_SHOWN) for r in roots)}); "
        "nothing was loaded, the old weights still serve"
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
