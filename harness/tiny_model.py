"""The tiny offline model: a random-weight Llama (or Mixtral), built here, offline.

Tests, the benchmark and ``make run`` need a real model that vLLM can load on a
CPU without any download: a byte-level BPE tokenizer trained here on generated
text, and a 2-layer model with random weights (about 1 MB). Everything derives
from the seed, so the same seed gives the same files byte for byte; a stamp
file lets a second call with the same settings return at once.

``tiny_model_dir(kind)`` is the cached build under ``.artifacts/``;
``build_tiny_model(out_dir, ...)`` builds anywhere (``python -m scripts.build_tiny_model``
is its command line). A model without a chat template is a base checkpoint, as
most RL base checkpoints are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from harness import ARTIFACTS

# Bump when the produced files change for the same seed.
BUILDER_VERSION = 1
STAMP_NAME = ".tiny_model_stamp.json"

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _stamp(seed: int, moe: bool, chat_template: bool) -> dict[str, object]:
    stamp: dict[str, object] = {"builder_version": BUILDER_VERSION, "seed": seed, "moe": moe}
    if not chat_template:  # builds with a template keep their old stamp
        stamp["chat_template"] = False
    return stamp


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Pseudo-English lines: a syllable vocabulary makes BPE learn real merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "th", "st"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "ng", "ck"]
    words = sorted(
        {
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 3))
            )
            for _ in range(600)
        }
    )
    punct = [".", ".", ".", "!", "?", ","]
    out = []
    for _ in range(lines):
        n = rng.randint(3, 14)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        out.append(sentence.capitalize() + rng.choice(punct))
    return out


def _train_tokenizer(seed: int, out_dir: Path, chat_template: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _build_model(seed: int, moe: bool, out_dir: Path) -> None:
    import torch

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        head_dim=32,  # vLLM's CPU attention needs head_dim >= 32
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so that logits are peaked enough for
        # greedy outputs to vary with the prompt instead of being near-uniform.
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    if moe:
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            **common,
        )
        model = MixtralForCausalLM(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, **common
        )
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _is_current(out_dir: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((out_dir / STAMP_NAME).read_text()) == stamp
    except (OSError, ValueError):
        return False


def build_tiny_model(
    out_dir: str | os.PathLike[str], seed: int = 0, moe: bool = False, chat_template: bool = True
) -> Path:
    """Build the model into ``out_dir`` unless it already holds this exact build.

    Builds in a sibling temporary folder and renames it into place, so a reader
    never sees a half-written model and concurrent builders do not collide.
    A non-empty ``out_dir`` that is not one of our builds is left alone (error).
    """
    out = Path(out_dir).resolve()
    stamp = _stamp(seed, moe, chat_template)
    if _is_current(out, stamp):
        return out
    if out.exists() and any(out.iterdir()) and not (out / STAMP_NAME).exists():
        raise FileExistsError(f"{out} exists and is not a tiny-model build; not overwriting")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _train_tokenizer(seed, tmp, chat_template)
        _build_model(seed, moe, tmp)
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            if _is_current(out, stamp):  # another builder won the race
                return out
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if not _is_current(out, stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


TinyModel = Literal["tiny", "base", "moe"]
# kind -> (folder under .artifacts, moe, chat template); all seed 0.
KINDS: dict[str, tuple[str, bool, bool]] = {
    "tiny": ("tiny-model", False, True),
    "base": ("tiny-base-model", False, False),
    "moe": ("tiny-moe-model", True, True),
}


def tiny_model_dir(kind: TinyModel = "tiny") -> Path:
    """The cached build of ``kind`` (seed 0), built on first use: ``tiny`` the Llama
    with a chat template, ``base`` the same without one, ``moe`` the Mixtral."""
    folder, moe, chat_template = KINDS[kind]
    return build_tiny_model(ARTIFACTS / folder, seed=0, moe=moe, chat_template=chat_template)
