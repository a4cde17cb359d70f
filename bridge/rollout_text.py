"""The text of a rollout that asks for it (``rollout:{"text": true}``).

Dynamo's frontend passes a rollout's chunk through undecoded (it must not hide
EOS or cut at stop strings), so the text, when a client wants it, is decoded
here: with the model folder's ``tokenizer.json`` (the one Dynamo's frontend
itself reads), special tokens skipped, loaded on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from bridge.codec import RequestError

log = logging.getLogger(__name__)


class RolloutText:
    def __init__(self, model_path: str) -> None:
        self._path = Path(model_path) / "tokenizer.json"
        self._tokenizer: Tokenizer | None = None

    def decode(self, token_ids: Sequence[int]) -> str:
        tokenizer = self._tokenizer
        if tokenizer is None:
            try:
                tokenizer = self._tokenizer = Tokenizer.from_file(str(self._path))
            except Exception as e:
                raise RequestError(
                    f"rollout spec 'text' needs the model's tokenizer at {self._path}, which "
                    f"cannot be read ({type(e).__name__}: {e}); leave 'text' out to get tokens only"
                ) from e
            log.info("rollout text: decoding with %s", self._path)
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)
