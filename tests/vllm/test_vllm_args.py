"""vLLM's engine flags on the engine server's command line (no engine started)."""

from __future__ import annotations

import os

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from engine_server.backends.vllm import VllmBackend, _env
from engine_server.backends.vllm.args import CORE_FLAGS, engine_args_from_namespace
from engine_server.cli import build_parser

pytestmark = pytest.mark.vllm


def test_core_and_vllm_flags_coexist() -> None:
    parser = build_parser("vllm")
    args = parser.parse_args(
        [
            "--backend", "vllm", "--listen", "127.0.0.1:0", "--log-level", "debug",
            "--temperature", "0.7", "--top-k", "20", "--max-new-tokens", "64",
            "--model", "/models/x", "--max-model-len", "512", "--block-size", "32",
            "--kv-cache-memory-bytes", "6M", "--enforce-eager", "--vllm-log-level", "WARNING",
            "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5599"}',
            "--no-enable-prefix-caching", "-tp", "1",
        ]
    )  # fmt: skip
    # core flags keep their meaning
    assert args.log_level == "debug" and args.temperature == 0.7 and args.top_k == 20
    ea = engine_args_from_namespace(args)
    assert ea.model == "/models/x" and ea.max_model_len == 512 and ea.block_size == 32
    assert ea.kv_cache_memory_bytes == 6 << 20 and ea.enforce_eager
    assert ea.log_level == "WARNING"  # vLLM's own --log-level, renamed
    assert ea.kv_events_config.endpoint == "tcp://*:5599"
    assert ea.enable_prefix_caching is False and ea.tensor_parallel_size == 1
    backend = VllmBackend.from_cli_args(args)
    assert backend.defaults_applied == {}  # the user chose everything


def test_defaults_only_where_the_user_gave_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = build_parser("vllm").parse_args(["--backend", "vllm", "--model", "/models/x"])
    backend = VllmBackend.from_cli_args(args)
    want = {"enable_prefix_caching": True}
    if _env.is_cpu_build():
        want["kv_cache_memory_bytes"] = 1 << 30
    assert backend.defaults_applied == want
    # every other engine argument is vLLM's own default, as `vllm serve` parses it
    parsed = engine_args_from_namespace(args)
    plain = AsyncEngineArgs(model="/models/x")
    differ = {
        f: getattr(parsed, f)
        for f in AsyncEngineArgs.__dataclass_fields__
        if getattr(parsed, f) != getattr(plain, f)
    }
    assert set(differ) <= {"mm_device_do_normalize", "enable_lora", "reasoning_parser_plugin"}


def test_no_core_flag_is_shadowed() -> None:
    parser = build_parser("vllm")
    for flag in CORE_FLAGS - {"-h", "--help"}:
        action = parser._option_string_actions.get(flag)
        if action is not None:
            assert not action.dest.startswith("vllm_"), flag


def test_cpu_env_defaults_respect_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "is_cpu_build", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert _env.apply_env_defaults() == {"TORCHDYNAMO_DISABLE": "1"}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
