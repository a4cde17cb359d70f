"""The ``rollout:`` annotation: how a driver asks a worker for a rollout, one shape
for both sides.

A rollout is an ordinary ``/v1/completions`` request whose ``nvext.annotations``
(which reach the worker verbatim) hold ``rollout:<JSON object>``, the object a
``RolloutSpec``: every key optional, no others allowed. The driver writes it
(``rollout_annotation``, from ``rl_client.driver``) and the bridge reads it
(``parse_rollout_spec``, from ``bridge.codec``), here once so that the two never
disagree on a key; the answer is ``rl_client.wire``'s. No Dynamo import here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine_contract.labels import label_problem
from engine_contract.text import clip, text_problem

__all__ = [
    "KEYS",
    "KIND",
    "AnnotationError",
    "RolloutSpec",
    "parse_rollout_spec",
    "rollout_annotation",
]

# The annotation's name: ``rollout:`` before its JSON.
KIND = "rollout"


class AnnotationError(ValueError):
    """The JSON after ``rollout:`` is malformed, or holds a key or value a rollout
    does not take."""


@dataclass(frozen=True)
class RolloutSpec:
    """The JSON after ``rollout:``; every key optional, no others allowed."""

    greedy: bool = False
    stop_strings: tuple[str, ...] = ()
    request_id: str | None = None
    # Also answer the completion's text in ``choices[0].text`` (decoded by the
    # bridge, special tokens skipped): for OpenAI clients and tools like aiperf,
    # which count an answer without text as failed. Off by default: RL drivers
    # read the tokens, and decoding costs the bridge CPU.
    text: bool = False
    # The weight version every token must come from (contract revision 8's
    # required_weight_version): refused by an engine serving another, ended with
    # finish reason "weight_version_changed" when the weights change under it.
    weight_version: str | None = None


KEYS = frozenset(f.name for f in fields(RolloutSpec))


def rollout_annotation(
    *,
    greedy: bool = False,
    stop_strings: Sequence[str] = (),
    request_id: str | None = None,
    text: bool = False,
    weight_version: str | None = None,
) -> str:
    """The annotation a driver sends: ``greedy`` always, the other keys when set."""
    spec: dict[str, Any] = {"greedy": greedy}
    if stop_strings:
        spec["stop_strings"] = list(stop_strings)
    if request_id is not None:
        spec["request_id"] = request_id
    if text:
        spec["text"] = True
    if weight_version is not None:
        spec["weight_version"] = weight_version
    return f"{KIND}:" + json.dumps(spec, separators=(",", ":"))


def _text(field: str, value: str) -> str:
    problem = text_problem(field, value)
    if problem is not None:
        raise AnnotationError(problem)
    return value


def parse_rollout_spec(text: str) -> RolloutSpec:
    """Parse and validate the JSON after ``rollout:``; wrong keys and types are
    ``AnnotationError``s."""
    if not text.strip():
        return RolloutSpec()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise AnnotationError(f"rollout spec is not valid JSON: {e}") from e
    except RecursionError:
        raise AnnotationError("rollout spec is nested too deeply to be a rollout spec") from None
    if not isinstance(obj, dict):
        raise AnnotationError(f"rollout spec must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - KEYS)
    if unknown:
        raise AnnotationError(
            f"rollout spec has unknown keys {clip(unknown)}; allowed: {sorted(KEYS)}"
        )
    greedy = obj.get("greedy", False)
    if not isinstance(greedy, bool):
        raise AnnotationError(f"rollout spec 'greedy' must be a boolean, got {greedy!r}")
    stops = obj.get("stop_strings", [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise AnnotationError("rollout spec 'stop_strings' must be a list of non-empty strings")
    for i, stop in enumerate(stops):
        _text(f"rollout spec 'stop_strings'[{i}]", stop)
    request_id = obj.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise AnnotationError("rollout spec 'request_id' must be a non-empty string")
    if request_id is not None:
        _text("rollout spec 'request_id'", request_id)
    text = obj.get("text", False)
    if not isinstance(text, bool):
        raise AnnotationError(f"rollout spec 'text' must be a boolean, got {clip(text)}")
    return RolloutSpec(
        greedy=greedy,
        stop_strings=tuple(stops),
        request_id=request_id,
        text=text,
        weight_version=_weight_version(obj.get("weight_version")),
    )


def _weight_version(value: Any) -> str | None:
    """A version label as the engine server takes one (``engine_contract.labels``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise AnnotationError(f"rollout spec 'weight_version' must be a string, got {clip(value)}")
    problem = label_problem(_text("rollout spec 'weight_version'", value))
    if problem is not None:
        raise AnnotationError(f"rollout spec 'weight_version' {problem}")
    return value
