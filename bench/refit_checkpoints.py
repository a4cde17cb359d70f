"""Part 6's checkpoints, built here, offline: a synthetic one for the sim engine and
a Llama of a few hundred MB for vLLM, both with the tiny model's tokenizer."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_server.backends.checkpoint import SafetensorsWriter
from engine_server.backends.refit import TensorSpec


def _model_files(model_dir: Path, out: Path) -> None:
    """``model_dir``'s files but its weights and hidden files (its tokenizer and
    config), copied into ``out``."""
    out.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith("."):
            shutil.copy2(file, out / file.name)


def _write(specs: list[TensorSpec], seed: int, out: Path) -> None:
    """``out/model.safetensors`` holding ``specs``: random normal values scaled by
    0.02, norms (1-d tensors) ones."""
    rng = np.random.default_rng(seed)
    writer = SafetensorsWriter(specs)
    try:
        for spec in specs:
            if len(spec.shape) == 1:
                values = np.ones(spec.shape, dtype=np.float32)
            else:
                values = rng.standard_normal(spec.shape, dtype=np.float32)
                values *= 0.02
            writer.write(memoryview(values.tobytes()))
        writer.close()
        shutil.move(writer.directory / "model.safetensors", out / "model.safetensors")
    finally:
        writer.remove()


def synthetic_model(model_dir: Path, out: Path, mb: int, seed: int) -> Path:
    """``model_dir``'s tokenizer and config with a synthetic checkpoint of ``mb`` MB
    (float32 tensors of 4 MB): what the sim engine serves and refits."""
    _model_files(model_dir, out)
    specs = [TensorSpec(f"layers.{i}.weight", "float32", (1024, 1024)) for i in range(mb // 4)]
    _write(specs, seed, out)
    return out


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a float32 Llama (no tied embeddings; heads of 64)."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    head_dim: int = 64

    def specs(self) -> list[TensorSpec]:
        """Its tensors, named as Hugging Face's ``LlamaForCausalLM`` names them."""
        h, i = self.hidden, self.intermediate

        def spec(name: str, *shape: int) -> TensorSpec:
            return TensorSpec(name, "float32", shape)

        out = [spec("model.embed_tokens.weight", self.vocab, h)]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                spec(p + "input_layernorm.weight", h),
                *(spec(f"{p}self_attn.{x}_proj.weight", h, h) for x in "qkvo"),
                spec(p + "post_attention_layernorm.weight", h),
                spec(p + "mlp.gate_proj.weight", i, h),
                spec(p + "mlp.up_proj.weight", i, h),
                spec(p + "mlp.down_proj.weight", h, i),
            ]
        return [*out, spec("model.norm.weight", h), spec("lm_head.weight", self.vocab, h)]

    @property
    def mb(self) -> float:
        return sum(s.nbytes for s in self.specs()) / 1e6


# About 306 MB (77M parameters); the quick run's about 84 MB.
LLAMA_300MB = LlamaShape(hidden=1024, intermediate=2816, layers=4, vocab=12288)
LLAMA_QUICK = LlamaShape(hidden=1024, intermediate=2816, layers=1, vocab=4096)


def synthetic_llama(model_dir: Path, out: Path, shape: LlamaShape, seed: int) -> Path:
    """The tiny Llama ``model_dir`` grown to ``shape``: its tokenizer, its config with
    the new sizes, random weights from ``seed``. vLLM serves it (the vocabulary
    beyond the tokenizer's is never sampled by a tokenizer, but it is loaded)."""
    _model_files(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        vocab_size=shape.vocab,
        head_dim=shape.head_dim,
        num_attention_heads=shape.hidden // shape.head_dim,
        num_key_value_heads=shape.hidden // shape.head_dim,
        tie_word_embeddings=False,
        dtype="float32",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write(shape.specs(), seed, out)
    return out
