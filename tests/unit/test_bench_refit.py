"""Part 6 of the bench: issue 30's goal (gloo's MB/s not below loading the same
checkpoint from disk) per vLLM row, and the synthetic Llama it refits: Hugging
Face's tensor names, a checkpoint vLLM can serve."""

import json
from pathlib import Path

from bench.__main__ import goals_line
from bench.refit import DISK, GLOO, TCP, Refit, Row
from bench.refit_checkpoints import LLAMA_300MB, LlamaShape, synthetic_llama
from engine_server.backends.checkpoint import checkpoint_schema


def _row(name: str, mb: float, seconds: dict[str, float]) -> Row:
    return Row(
        name, mb, {p: [s * 2] for p, s in seconds.items()}, {p: [s] for p, s in seconds.items()}
    )


def test_each_row_with_gloo_has_the_goal_and_says_whether_it_was_met() -> None:
    part = Refit(
        [
            _row("sim", 256.0, {DISK: 0.2, TCP: 0.4}),  # no gloo: no goal
            _row("tiny", 1.0, {DISK: 0.04, GLOO: 0.03}),
            _row("llama", 300.0, {DISK: 0.15, GLOO: 0.3}),
        ]
    )
    goals = {g.what: g for g in part.goals()}
    assert list(goals) == ["gloo MB/s over disk's, tiny", "gloo MB/s over disk's, llama"]
    assert goals["gloo MB/s over disk's, tiny"].met
    assert goals["gloo MB/s over disk's, llama"].measured == "0.50"
    assert not goals["gloo MB/s over disk's, llama"].met
    text = part.render()
    assert "Goals (issue 30):" in text and "| llama | 300.0 | gloo |" in text
    line = goals_line({6: part})
    assert line is not None and line.startswith("**Goals: 1 of 2 met in this run** (part 6;")


def test_a_row_whose_gloo_path_was_not_measured_misses_the_goal() -> None:
    part = Refit([Row("llama", 300.0, {DISK: [0.3], GLOO: []}, {DISK: [0.15], GLOO: []})])
    assert [g.met for g in part.goals()] == [False]


def test_the_synthetic_llama_has_the_tiny_llamas_tensor_names(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    tiny = LlamaShape(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        vocab=config["vocab_size"],
    )
    assert {s.name for s in tiny.specs()} == set(checkpoint_schema(model_dir))
    assert 250 < LLAMA_300MB.mb < 350


def test_a_synthetic_llama_is_a_model_folder_of_its_shape(model_dir: Path, tmp_path: Path) -> None:
    shape = LlamaShape(hidden=128, intermediate=256, layers=1, vocab=2048)
    out = synthetic_llama(model_dir, tmp_path / "llama", shape, seed=3)
    schema = checkpoint_schema(out)
    assert {n: s.shape for n, s in schema.items()} == {s.name: s.shape for s in shape.specs()}
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["vocab_size"]) == (
        128,
        2,
        2048,
    )
    assert (out / "tokenizer.json").is_file() and not (out / ".tiny_model_stamp.json").exists()
