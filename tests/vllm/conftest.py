"""Shared pieces of the vLLM-level tests: the tiny model and engine helpers.

Each test module starts one engine (15-25 s on two cores) in a module-scoped
fixture on a module-scoped event loop, and its tests share it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

if VLLM_INSTALLED:
    from engine_server.backends.vllm._env import apply_env_defaults

    # Before any test module imports vLLM (and with it torch): the CPU build's
    # environment defaults, exactly as `--backend vllm` gets them.
    apply_env_defaults()
else:
    # Nothing here can run without vLLM (importing the backend imports it).
    collect_ignore_glob = ["test_vllm_*.py"]

ROOT = Path(__file__).resolve().parents[2]


def _builder() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_tiny_model", ROOT / "scripts" / "build_tiny_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama (seed 0), built once into .artifacts/ and reused."""
    return _builder().build_tiny_model(ROOT / ".artifacts" / "tiny-model", seed=0)
