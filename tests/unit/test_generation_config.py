"""NeMo RL's generation section read as is: sampling, engine settings, what is ignored."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from engine_server.backends.sim import SimBackend
from engine_server.cli import backend_and_config, build_parser
from engine_server.generation_config import (
    GenerationConfigError,
    load_generation_config,
    parse_generation_config,
)

# policy.generation of a NeMo RL GRPO recipe, resolved (OmegaConf resolve=True).
NEMO_RL_YAML = """\
policy:
  model_name: Qwen/Qwen2.5-1.5B
  max_total_sequence_length: 512
  generation:
    backend: vllm
    max_new_tokens: 512
    temperature: 0.8
    top_p: 0.95
    top_k: null
    stop_token_ids: null
    stop_strings: ["</answer>"]
    val_temperature: 0.8
    val_top_p: 0.95
    val_top_k: null
    vllm_cfg:
      async_engine: true
      precision: bfloat16
      tensor_parallel_size: 1
      pipeline_parallel_size: 1
      expert_parallel_size: 1
      gpu_memory_utilization: 0.6
      max_model_len: 512
      enforce_eager: false
      use_deep_gemm: false
    colocated:
      enabled: true
      resources: {gpus_per_node: null, num_nodes: null}
"""


def test_a_whole_nemo_rl_config_is_read_from_its_generation_section(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text(NEMO_RL_YAML)
    config = load_generation_config(path)
    defaults = config.defaults()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.8, 0.95, -1)
    assert defaults.max_new_tokens == 512 and defaults.stop_token_ids == ()
    assert defaults.stop_strings == ("</answer>",)
    assert config.engine == {
        "precision": "bfloat16",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 512,
        "enforce_eager": False,
    }
    ignored = {note.split(":")[0] for note in config.ignored}
    assert ignored == {
        "policy.generation.backend",
        "policy.generation.val_temperature",
        "policy.generation.val_top_p",
        "policy.generation.val_top_k",
        "policy.generation.vllm_cfg.async_engine",
        "policy.generation.vllm_cfg.use_deep_gemm",
        "policy.generation.colocated",
    }


@pytest.mark.parametrize("wrap", ["section", "generation", "policy"])
def test_the_section_may_sit_at_three_places(tmp_path: Path, wrap: str) -> None:
    section = {"temperature": 0.5, "ignore_eos": True, "bad_words": ["x"], "my_key": 1}
    data = {"section": section, "generation": {"generation": section}}.get(
        wrap, {"policy": {"generation": section}}
    )
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(data))
    config = load_generation_config(path)
    assert config.sampling == {"temperature": 0.5, "ignore_eos": True, "bad_words": ("x",)}
    assert [n.split(":")[0].rsplit(".", 1)[-1] for n in config.ignored] == ["my_key"]
    assert "unknown key" in config.ignored[0]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"temperature": "hot"}, "temperature: expected a finite number"),
        ({"top_p": 0}, "top_p: 0.0 is outside (0, 1]"),
        ({"top_k": -3}, "top_k: -3"),
        ({"max_new_tokens": -1}, "max_new_tokens: -1 is below 0"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids: expected a list of int"),
        ({"stop_strings": ["a", ""]}, "stop_strings: stop strings must not be empty"),
        ({"ignore_eos": "yes"}, "ignore_eos: expected true or false"),
        ({"vllm_cfg": {"max_model_len": 1.5}}, "vllm_cfg.max_model_len: expected an integer"),
        ({"vllm_cfg": []}, "vllm_cfg: expected a mapping"),
        ({"max_new_tokens": "${policy.max_total_sequence_length}"}, "unresolved interpolation"),
    ],
)
def test_bad_values_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(
        GenerationConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        parse_generation_config({"generation": section}, "test")


def test_unreadable_files_say_why(tmp_path: Path) -> None:
    with pytest.raises(GenerationConfigError, match="No such file"):
        load_generation_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation: [unclosed")
    with pytest.raises(GenerationConfigError, match="not valid YAML"):
        load_generation_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3")
    with pytest.raises(GenerationConfigError, match="a mapping at the top"):
        load_generation_config(scalar)


def sim_args(tmp_path: Path, section: dict[str, object], *flags: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "gen.yaml"
    path.write_text(json.dumps({"generation": section}))  # JSON is YAML
    return build_parser("sim").parse_args(["--generation-config", str(path), *flags])


def test_the_file_drives_the_server_and_flags_given_win(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    section = {
        "temperature": 0.6,
        "top_k": 20,
        "max_new_tokens": 48,
        "stop_strings": ["."],
        "vllm_cfg": {"max_model_len": 256, "precision": "float32"},
        "val_top_k": 5,
    }
    with caplog.at_level(logging.INFO, logger="engine_server"):
        backend, config = backend_and_config(sim_args(tmp_path, section, "--top-k", "7"))
    assert isinstance(backend, SimBackend) and backend.config.context_length == 256
    d = config.defaults
    assert (d.temperature, d.top_k, d.max_new_tokens, d.stop_strings) == (0.6, 7, 48, (".",))
    logged = caplog.text
    assert "ignored generation.val_top_k" in logged
    assert "ignored vllm_cfg.precision: the sim backend has no such setting" in logged
    # A flag given wins over the file for engine settings too.
    backend, _ = backend_and_config(sim_args(tmp_path, section, "--context-length", "128"))
    assert isinstance(backend, SimBackend) and backend.config.context_length == 128


def test_a_backend_without_bad_words_refuses_them_at_start(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="bad_words: the sim backend does not support them"):
        backend_and_config(sim_args(tmp_path, {"bad_words": ["no"]}))


def test_an_unusable_file_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="top_p"):
        backend_and_config(sim_args(tmp_path, {"top_p": 2}))
