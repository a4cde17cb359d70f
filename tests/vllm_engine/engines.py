"""The tiny model's vLLM engine, as these tests build it (import it after
``pytest.importorskip("vllm")``: this module imports vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs


def tiny_engine_args(model_dir: Path, kv_cache_bytes: int, **overrides: Any) -> AsyncEngineArgs:
    """fp32, eager, 512 tokens of context in blocks of 32, a KV cache of
    ``kv_cache_bytes``, no tokenizer; ``overrides`` win."""
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 512,
        "dtype": "float32",
        "block_size": 32,
        "kv_cache_memory_bytes": kv_cache_bytes,
    }
    return AsyncEngineArgs(**{**fields, **overrides})
