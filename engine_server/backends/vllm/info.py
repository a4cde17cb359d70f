"""What a vLLM engine is, read from its own final configuration (after start-up):
the ``EngineInfo`` the server announces.

Apart from the backend because it only reads vLLM's config, wherever the engine
came from (created here or the host's).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import vllm
from vllm.v1.engine.async_llm import AsyncLLM

from engine_server import vllm_compat as compat
from engine_server.backends.base import EngineInfo


def eos_token_ids(engine: AsyncLLM) -> tuple[int, ...]:
    """Every id vLLM stops on by default: generation config, HF config, tokenizer.

    Read from the model's config files, so it works with skip_tokenizer_init.
    """
    mc = engine.model_config
    found: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, int))

    with contextlib.suppress(Exception):
        add(mc.try_get_generation_config().get("eos_token_id"))
    add(getattr(mc.hf_text_config, "eos_token_id", None))
    tok = engine.tokenizer
    if tok is not None:
        add(getattr(tok, "eos_token_id", None))
    if not found:  # last resort: the files themselves
        for name in ("generation_config.json", "config.json"):
            path = Path(mc.model) / name
            with contextlib.suppress(OSError, ValueError):
                add(json.loads(path.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(found))


def _dp_ranks(parallel: Any) -> dict[str, int]:
    """The ranks this engine hosts: all of them (vLLM balances internally), or
    with an external or hybrid load balancer its own share, from its own rank."""
    if parallel.data_parallel_external_lb:
        size, start = 1, parallel.data_parallel_rank
    elif parallel.data_parallel_hybrid_lb:
        size, start = parallel.data_parallel_size_local, parallel.data_parallel_rank
    else:
        size, start = parallel.data_parallel_size, 0
    return {"data_parallel_size": int(size), "data_parallel_start_rank": int(start)}


def engine_info(engine: AsyncLLM) -> EngineInfo:
    """EngineInfo from vLLM's own, final configuration (after start-up)."""
    cfg = engine.vllm_config
    mc = cfg.model_config
    served = mc.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return EngineInfo(
        model_name=str(served or mc.model),
        model_path=str(mc.model),
        context_length=int(mc.max_model_len),
        kv_block_size=int(cfg.cache_config.block_size),
        total_kv_blocks=int(cfg.cache_config.num_gpu_blocks or 0),
        max_running_sequences=int(cfg.scheduler_config.max_num_seqs),
        max_batched_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
        eos_token_ids=eos_token_ids(engine),
        vocab_size=int(mc.get_vocab_size()),
        backend_name="vllm",
        backend_version=vllm.__version__,
        **_dp_ranks(cfg.parallel_config),
        reports_routed_experts=compat.returns_routed_experts(cfg),
    )
