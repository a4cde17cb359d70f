"""A request's cache salt: its prefix-cache namespace (contract revision 11).

Dynamo's requests carry it in two places, read as dynamo.vllm reads them: the
client's ``nvext.cache_salt`` (completions, chat, rollouts; Dynamo's
preprocessor passes nvext on in ``extra_args.nvext``) and, for vLLM's
``/inference/v1/generate``, the token-in/token-out envelope's ``cache_salt``.
An empty salt is none. Every engine server the bridge accepts honours it (the
supported revisions, docs/contract.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.codec import RequestError, nvext_sources
from engine_contract.labels import label_problem
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb


def requested(request: Mapping[str, Any], envelope: Mapping[str, Any] | None) -> str | None:
    """The salt the request asks for (the envelope's first, as dynamo.vllm), checked
    as a weight-version label is (printable, 1..256 characters); None: none."""
    places = [("cache_salt", envelope)] if envelope is not None else []
    places += [("nvext.cache_salt", nvext) for nvext in nvext_sources(request)]
    for field, place in places:
        salt = place.get("cache_salt")
        if salt is None or salt == "":
            continue
        if not isinstance(salt, str):
            raise RequestError(f"{field} must be a string, got {clip(salt)}")
        problem = label_problem(salt)
        if problem is not None:
            raise RequestError(f"{field}: {problem}")
        return salt
    return None


def apply(message: pb.RolloutRequest | pb.GenerateRequest, salt: str | None) -> None:
    """Put ``salt`` on the engine request."""
    if salt is not None:
        message.cache_salt = salt
