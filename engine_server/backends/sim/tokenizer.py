"""Vocabulary, EOS ids and detokenization for the simulated engine.

Stop strings are matched on detokenized text, as real engines do, so the sim
needs text for every token id: either a built-in made-up vocabulary or a real
``tokenizer.json`` from an HF-style model directory (``--model DIR``).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeio"
# 64 syllables: a token's word spells its id in base 64.
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)


class TextStream(ABC):
    """Incremental detokenizer of one request's generated tokens."""

    @abstractmethod
    def step(self, token_id: int) -> str:
        """Text that this token adds (may be empty until a character completes)."""


class SimTokenizer(ABC):
    """What the sim needs from a tokenizer: sizes, EOS ids and text."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens, special tokens skipped (vLLM's default)."""

    @abstractmethod
    def new_stream(self, prompt_token_ids: Sequence[int]) -> TextStream:
        """A detokenizer for what follows this prompt."""


class BuiltinTokenizer(SimTokenizer):
    """A made-up vocabulary: id 0 ``<unk>``, id 1 ``<s>``, EOS ``</s>``, else words.

    Every other id is a space and a word spelling the id in base-64 syllables
    (``" ba"``, ``" dobe"``, ...), so text is concatenative and distinct ids
    have distinct words. Special tokens decode to nothing, like
    ``skip_special_tokens=True``.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.special_tokens: dict[int, str] = {0: "<unk>", 1: "<s>"}
        for eos in self.eos_token_ids:
            self.special_tokens[eos] = "</s>"

    def token_text(self, token_id: int) -> str:
        """The token's text in decoded output ("" for special tokens)."""
        if token_id in self.special_tokens or not 0 <= token_id < self.vocab_size:
            return ""
        digits = []
        n = token_id
        while True:
            n, d = divmod(n, 64)
            digits.append(_SYLLABLES[d])
            if n == 0:
                break
        return " " + "".join(reversed(digits))

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.token_text(t) for t in token_ids)

    def new_stream(self, prompt_token_ids: Sequence[int]) -> TextStream:
        return _BuiltinStream(self)


class _BuiltinStream(TextStream):
    def __init__(self, tokenizer: BuiltinTokenizer) -> None:
        self._tokenizer = tokenizer

    def step(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)


class HfTokenizer(SimTokenizer):
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ValueError(
                "--model needs the 'tokenizers' package (pip install 'dynamo-rl-engine[sim]')"
            ) from e
        self._tokenizer: Any = Tokenizer.from_file(str(path))
        self._known = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        # Ids past the tokenizer's vocabulary (padded embeddings) have no text.
        ids = [t for t in token_ids if t < self._known]
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def new_stream(self, prompt_token_ids: Sequence[int]) -> TextStream:
        return _HfStream(self._tokenizer, self._known, prompt_token_ids)


class _HfStream(TextStream):
    """tokenizers' DecodeStream primed with the prompt, as vLLM's detokenizer does."""

    def __init__(self, tokenizer: Any, known: int, prompt_token_ids: Sequence[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._known = known
        prompt = [t for t in prompt_token_ids if t < known]
        try:
            self._stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        except TypeError:  # tokenizers < 0.22 cannot prime with the prompt
            self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        if token_id >= self._known:
            return ""
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception:  # a broken UTF-8 prefix: restart the stream, like vLLM
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._tokenizer, token_id) or ""


@dataclass(frozen=True)
class ModelDir:
    """What the sim reads from an HF-style model directory."""

    path: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _eos_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"--model: eos_token_id must be an int or a list of ints, got {value!r}")


def read_model_dir(model_dir: str) -> ModelDir:
    """Vocabulary size and EOS ids of a model directory.

    vocab_size comes from ``config.json`` (or its ``text_config``), else from the
    tokenizer. EOS ids from ``generation_config.json``, else ``config.json``;
    none found means no EOS (only stop tokens and lengths end requests).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model: {model_dir!r} is not a directory")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--model: {model_dir!r} has no tokenizer.json")
    config = _read_json(path / "config.json")
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        text_config = {}
    generation = _read_json(path / "generation_config.json")
    eos = _eos_ids(generation.get("eos_token_id"))
    if eos is None:
        eos = _eos_ids(config.get("eos_token_id", text_config.get("eos_token_id")))
    vocab = config.get("vocab_size", text_config.get("vocab_size"))
    if vocab is None:
        vocab = _tokenizer_vocab_size(path / "tokenizer.json")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model: bad vocab_size {vocab!r} in {path / 'config.json'}")
    return ModelDir(path=path, vocab_size=vocab, eos_token_ids=eos or ())


def _tokenizer_vocab_size(path: Path) -> int:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ValueError("--model needs the 'tokenizers' package") from e
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
