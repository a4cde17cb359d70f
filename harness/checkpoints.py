"""Second checkpoints of the tiny model, for refit tests and benchmarks.

``tiny_weights_dir(seed)`` is a full model folder: the seed-0 model's tokenizer
and config with seed-``seed`` weights. It is what a trainer's step writes (same
names, dtypes and shapes, new values), and a fresh engine started on it is the
reference a refit to it must reproduce exactly.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from engine_contract.tensors import Tensor
from harness import ARTIFACTS
from harness.tiny_model import KINDS, TinyModel, build_tiny_model, tiny_model_dir


def tiny_weights_dir(seed: int, kind: TinyModel = "tiny") -> Path:
    folder, moe, chat_template = KINDS[kind]
    out = ARTIFACTS / f"{folder}-weights-seed{seed}"
    if (out / "model.safetensors").is_file():
        return out
    base = tiny_model_dir(kind)
    other = build_tiny_model(
        ARTIFACTS / f"{folder}-seed{seed}", seed=seed, moe=moe, chat_template=chat_template
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=ARTIFACTS))
    try:
        for file in base.iterdir():
            if file.suffix != ".safetensors" and file.is_file():
                shutil.copy2(file, tmp / file.name)
        for file in other.glob("*.safetensors"):
            shutil.copy2(file, tmp / file.name)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:  # another builder won the race
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint_tensors(model_dir: Path) -> list[Tensor]:
    """Every tensor of a checkpoint folder, ready for ``update_requests``."""
    from engine_server.backends.checkpoint import checkpoint_files, read_safetensors

    return [
        Tensor(spec.name, spec.dtype, spec.shape, bytes(data))
        for file in checkpoint_files(model_dir)
        for spec, data in read_safetensors(file)
    ]


def unreadable_entry(folder: Path, kind: str) -> Path:
    """``folder/x.safetensors`` made a checkpoint entry no reader may open as a file:
    a "directory", a "dangling symlink", a "FIFO" (opening it would block) or a
    "socket"."""
    entry = folder / "x.safetensors"
    if kind == "directory":
        entry.mkdir()
    elif kind == "dangling symlink":
        entry.symlink_to(folder / "gone")
    elif kind == "FIFO":
        os.mkfifo(entry)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(entry))
        sock.close()
    else:
        raise ValueError(f"unknown kind of entry: {kind}")
    return entry
