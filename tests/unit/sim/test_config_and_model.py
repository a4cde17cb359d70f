"""CLI flags, config validation, routed experts and the --model DIR path."""

from __future__ import annotations

import argparse
import json
from array import array

import pytest

from engine_server.backends import load_backend_class
from engine_server.backends.base import FinishReason, SamplingSpec
from engine_server.backends.sim import RoutedExpertsConfig, SimBackend, SimConfig
from tests.unit.sim.sim_helpers import collect, tokens_of


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    SimBackend.add_cli_args(parser)
    assert any(g.title == "sim backend" for g in parser._action_groups)
    return parser.parse_args(argv)


def test_registry_points_at_sim_backend():
    assert load_backend_class("sim") is SimBackend


def test_cli_defaults_match_config_defaults():
    backend = SimBackend.from_cli_args(parse([]))
    assert backend.config == SimConfig()


def test_every_sim_flag_sets_its_config_field():
    args = parse(
        [
            "--served-model-name", "demo", "--seed", "9", "--context-length", "1024",
            "--block-size", "32", "--num-kv-blocks", "64", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "512", "--prefill-tokens-per-s", "1000",
            "--decode-step-ms", "2.5", "--zero-delay", "--routed-experts", "4,2,300",
            "--startup-delay-s", "0.5", "--vocab-size", "500", "--eos-token-id", "7,8",
            "--eos-rate", "0.01",
        ]
    )  # fmt: skip
    config = SimBackend.from_cli_args(args).config
    assert config == SimConfig(
        served_model_name="demo",
        seed=9,
        context_length=1024,
        block_size=32,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        prefill_tokens_per_s=1000.0,
        decode_step_ms=2.5,
        zero_delay=True,
        routed_experts=RoutedExpertsConfig(4, 2, 300),
        startup_delay_s=0.5,
        vocab_size=500,
        eos_token_ids=(7, 8),
        eos_rate=0.01,
    )
    with pytest.raises(SystemExit):
        parse(["--routed-experts", "4,2"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"context_length": 4096, "num_kv_blocks": 10}, "does not fit"),
        ({"max_num_seqs": 300, "max_num_batched_tokens": 100}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"vocab_size": 10, "eos_token_ids": (10,)}, "outside the vocabulary"),
        ({"routed_experts": None, "eos_rate": 2.0}, "eos_rate"),
    ],
)
def test_an_inconsistent_sim_config_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SimBackend(**fields)
    with pytest.raises(ValueError, match="top_k"):
        RoutedExpertsConfig(2, 9, 8)


async def test_routed_experts_come_with_the_final_output_only_and_repeat(make_backend):
    backend, _ = await make_backend(routed_experts=RoutedExpertsConfig(3, 2, 64))
    assert backend.info.reports_routed_experts
    prompt = list(range(10, 30))
    spec = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    outs = await collect(backend, "r", prompt, spec)
    experts = outs[-1].routed_experts
    assert experts is not None and all(o.routed_experts is None for o in outs[:-1])
    rows = len(prompt) + 8 - 1
    assert experts.shape == (rows, 3, 2) and experts.dtype == "uint8"
    assert len(experts.data) == rows * 3 * 2
    values = list(experts.data)
    pairs = [values[i : i + 2] for i in range(0, len(values), 2)]
    assert all(a != b and a < 64 and b < 64 for a, b in pairs)
    assert len(set(map(tuple, pairs))) > 10
    again = await collect(backend, "r2", prompt, spec)
    assert again[-1].routed_experts == experts
    plain = await collect(backend, "p", prompt, SamplingSpec(max_tokens=2))
    assert plain[-1].routed_experts is None


async def test_routed_experts_past_256_experts_are_uint16(make_backend):
    backend, _ = await make_backend(routed_experts=RoutedExpertsConfig(2, 4, 300))
    spec = SamplingSpec(max_tokens=3, ignore_eos=True, return_routed_experts=True)
    experts = (await collect(backend, "r", [1, 2, 3, 4], spec))[-1].routed_experts
    assert experts is not None and experts.dtype == "uint16" and experts.shape == (6, 2, 4)
    assert len(experts.data) == 6 * 2 * 4 * 2
    values = array("H")
    values.frombytes(experts.data)  # little-endian on the machines we test on
    assert 255 < max(values) < 300
    rows = [values[i : i + 4] for i in range(0, len(values), 4)]
    assert all(len(set(row)) == 4 for row in rows)


@pytest.fixture
def model_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "foo", "bar", "baz", "qux", "stop"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory = tmp_path / "tiny-model"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 12, "eos_token_id": 1}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    return directory


async def test_a_model_folder_sets_the_vocabulary_text_and_eos(make_backend, model_dir):
    backend, _ = await make_backend(model=str(model_dir), context_length=256)
    info = backend.info
    assert info.model_name == "tiny-model" and info.model_path == str(model_dir)
    assert (info.vocab_size, info.eos_token_ids) == (12, (2, 9))
    tok = backend.tokenizer
    assert tok.decode([3, 4, 2, 11]) == "hello world"  # specials skipped, 11 has no text
    spec = SamplingSpec(max_tokens=60, temperature=0.0, ignore_eos=True)
    reference = tokens_of(await collect(backend, "ref", [3, 4, 5], spec))
    assert set(reference) <= set(range(12))
    word_token = next(t for t in reference[5:] if 3 <= t < 10)
    word = tok.decode([word_token])
    index = reference.index(word_token)
    outs = await collect(
        backend,
        "r",
        [3, 4, 5],
        SamplingSpec(max_tokens=60, temperature=0.0, ignore_eos=True, stop_strings=(word,)),
    )
    assert tokens_of(outs) == reference[: index + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == word
    # EOS ids from generation_config.json end greedy rollouts.
    eos_run = await collect(backend, "e", [3, 4, 5], SamplingSpec(max_tokens=200, temperature=0.0))
    assert eos_run[-1].finish_reason is FinishReason.STOP
    assert tokens_of(eos_run)[-1] == eos_run[-1].stop_reason
    assert eos_run[-1].stop_reason in (2, 9)


def test_a_missing_or_incomplete_model_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        SimBackend(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        SimBackend(model=str(tmp_path))
