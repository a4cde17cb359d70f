"""NeMo RL's ``generation`` config section, read as is (``--generation-config FILE``).

A trainer already has its generation config (``policy.generation`` in a NeMo RL
YAML); rollouts must follow it without the user copying values into flags. The
file may hold the section itself, ``{generation: ...}`` or a whole NeMo RL
config (``{policy: {generation: ...}}``), as YAML or JSON, with interpolations
already resolved.

What it decides:

- rollout sampling (``GenerationDefaults``): ``temperature``, ``top_p``,
  ``top_k`` (null: off), ``max_new_tokens``, ``stop_token_ids`` (null: the
  model's EOS ids), ``stop_strings`` (merged with each rollout's own, as NeMo RL
  merges them), ``ignore_eos``, ``bad_words``;
- engine settings from ``vllm_cfg`` (``max_model_len``, ``precision``,
  parallel sizes, ``gpu_memory_utilization``, ``enforce_eager``, ...) and
  ``vllm_kwargs`` (engine arguments passed through), which each backend maps
  onto its own flags (``EngineBackend.generation_config_args``).

Every key the server does not use is listed in ``ignored`` with the reason, and
logged at start: nothing is dropped silently. A value of the wrong type is an
error naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_server.config import GenerationDefaults

# Keys of NeMo RL's generation section that concern the trainer or NeMo RL's
# own orchestration, not how a rollout is sampled.
NOT_FOR_ROLLOUTS = {
    "backend": "the engine server's own --backend decides",
    "model_name": "the engine server's own --model decides",
    "val_temperature": "validation sampling is not served (rollouts use temperature)",
    "val_top_p": "validation sampling is not served (rollouts use top_p)",
    "val_top_k": "validation sampling is not served (rollouts use top_k)",
    "colocated": "placement is NeMo RL's",
    "port_range_low": "placement is NeMo RL's",
    "port_range_high": "placement is NeMo RL's",
    "use_async_rollouts": "rollouts are always asynchronous here",
    "_pad_token_id": "padding is the driver's (rl_client.batch)",
}

# vllm_cfg keys that have an engine meaning, by the neutral name backends map.
ENGINE_KEYS = {
    "max_model_len": int,
    "precision": str,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "expert_parallel_size": int,
    "gpu_memory_utilization": float,
    "enforce_eager": bool,
    "kv_cache_dtype": str,
    "enable_return_routed_experts": bool,
    "load_format": str,
    "logprobs_mode": str,
    "skip_tokenizer_init": bool,
    "enable_prefix_caching": bool,
}
VLLM_CFG_NOT_USED = {
    "async_engine": "the engine server always runs vLLM's async engine",
}


class GenerationConfigError(ValueError):
    """The file is unreadable or a value is of the wrong kind; the message names the key."""


@dataclass(frozen=True)
class GenerationConfig:
    """What a NeMo RL generation section asks of the engine server."""

    # GenerationDefaults fields the section sets (others keep their defaults).
    sampling: dict[str, Any] = field(default_factory=dict)
    # Neutral engine settings from vllm_cfg (ENGINE_KEYS names).
    engine: dict[str, Any] = field(default_factory=dict)
    # vllm_kwargs, passed to the engine as they are.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # "key: why" for every key present and not used.
    ignored: tuple[str, ...] = ()
    source: str = ""

    def defaults(self, base: GenerationDefaults | None = None) -> GenerationDefaults:
        """``base`` (or the built-in defaults) with this section's sampling applied."""
        return dataclasses.replace(base or GenerationDefaults(), **self.sampling)


def load_generation_config(source: str | Path | Mapping[str, Any]) -> GenerationConfig:
    """Read a section from a YAML or JSON file, or take an already parsed mapping."""
    if isinstance(source, Mapping):
        return parse_generation_config(source, "<mapping>")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise GenerationConfigError(f"generation config {path}: {e.strerror or e}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else _yaml(text)
    except ValueError as e:
        raise GenerationConfigError(f"generation config {path}: not valid YAML/JSON: {e}") from e
    if not isinstance(data, Mapping):
        raise GenerationConfigError(f"generation config {path}: expected a mapping at the top")
    return parse_generation_config(data, str(path))


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from e


def _section(data: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The generation section and its dotted prefix, wherever it sits."""
    policy = data.get("policy")
    if isinstance(policy, Mapping) and isinstance(policy.get("generation"), Mapping):
        return policy["generation"], "policy.generation."
    if isinstance(data.get("generation"), Mapping):
        return data["generation"], "generation."
    return data, ""


def parse_generation_config(data: Mapping[str, Any], source: str) -> GenerationConfig:
    section, prefix = _section(data)
    _refuse_interpolations(section, prefix)
    sampling: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    engine_kwargs: dict[str, Any] = {}
    ignored: list[str] = []

    def key(name: str) -> str:
        return prefix + name

    for name, value in section.items():
        if name == "temperature":
            sampling["temperature"] = _number(key(name), value, low=0.0)
        elif name == "top_p":
            top_p = _number(key(name), value, low=0.0)
            if not 0 < top_p <= 1:
                raise GenerationConfigError(f"{key(name)}: {top_p} is outside (0, 1]")
            sampling["top_p"] = top_p
        elif name == "top_k":
            top_k = -1 if value is None else _integer(key(name), value)
            if top_k < -1:
                raise GenerationConfigError(f"{key(name)}: {top_k}; use null or -1 for off")
            sampling["top_k"] = -1 if top_k == 0 else top_k
        elif name == "max_new_tokens":
            sampling["max_new_tokens"] = _integer(key(name), value, low=0)
        elif name == "stop_token_ids":
            ids = [] if value is None else _list(key(name), value, int)
            if any(t < 0 for t in ids):
                raise GenerationConfigError(f"{key(name)}: token ids must be >= 0")
            sampling["stop_token_ids"] = tuple(ids)
        elif name == "stop_strings":
            stops = [] if value is None else _list(key(name), value, str)
            if any(not s for s in stops):
                raise GenerationConfigError(f"{key(name)}: stop strings must not be empty")
            sampling["stop_strings"] = tuple(dict.fromkeys(stops))
        elif name == "bad_words":
            words = [] if value is None else _list(key(name), value, str)
            sampling["bad_words"] = tuple(words)
        elif name == "ignore_eos":
            sampling["ignore_eos"] = _boolean(key(name), value)
        elif name == "vllm_cfg":
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise GenerationConfigError(f"{key(name)}: expected a mapping")
            for sub, subvalue in value.items():
                dotted = f"{key(name)}.{sub}"
                if sub in ENGINE_KEYS:
                    if subvalue is not None:
                        engine[sub] = _typed(dotted, subvalue, ENGINE_KEYS[sub])
                elif sub in VLLM_CFG_NOT_USED:
                    ignored.append(f"{dotted}: {VLLM_CFG_NOT_USED[sub]}")
                else:
                    ignored.append(f"{dotted}: not an engine setting the server knows")
        elif name == "vllm_kwargs":
            if value is None:
                continue
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise GenerationConfigError(f"{key(name)}: expected a mapping of engine arguments")
            engine_kwargs.update(value)
        elif name in NOT_FOR_ROLLOUTS:
            ignored.append(f"{key(name)}: {NOT_FOR_ROLLOUTS[name]}")
        else:
            ignored.append(f"{key(name)}: unknown key")
    return GenerationConfig(sampling, engine, engine_kwargs, tuple(ignored), source)


def _refuse_interpolations(value: Any, where: str) -> None:
    """OmegaConf interpolations (``${...}``) must be resolved before the file is written."""
    if isinstance(value, str) and "${" in value:
        raise GenerationConfigError(
            f"{where.rstrip('.') or 'generation config'}: unresolved interpolation {value!r}; "
            "write the config resolved (OmegaConf.to_yaml(cfg, resolve=True))"
        )
    if isinstance(value, Mapping):
        for k, v in value.items():
            _refuse_interpolations(v, f"{where}{k}.")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_interpolations(v, f"{where.rstrip('.')}[{i}].")


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        return _boolean(key, value)
    if kind is int:
        return _integer(key, value)
    if kind is float:
        return _number(key, value)
    if not isinstance(value, str):
        raise GenerationConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise GenerationConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _integer(key: str, value: Any, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationConfigError(f"{key}: expected an integer, got {value!r}")
    if low is not None and value < low:
        raise GenerationConfigError(f"{key}: {value} is below {low}")
    return value


def _number(key: str, value: Any, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GenerationConfigError(f"{key}: expected a finite number, got {value!r}")
    if low is not None and value < low:
        raise GenerationConfigError(f"{key}: {value} is below {low}")
    return float(value)


def _list(key: str, value: Any, kind: type) -> list[Any]:
    if not isinstance(value, list) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    ):
        raise GenerationConfigError(f"{key}: expected a list of {kind.__name__}, got {value!r}")
    return list(value)
