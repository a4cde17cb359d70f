"""What every RL admin route shares: its error answer and what kind of error it
is, the body's values read as dynamo.vllm takes them (checked before any RPC, so
a bad value never reaches the engine server or an answer), the refusals answered
before any RPC, and a successful update's answer. Used by ``bridge.admin.rl_admin``
and ``bridge.admin.weight_transfer``.

Why an error has a kind (``ErrorKind``): one handler serves three spellings of
the routes (``bridge.admin.surface``), and each spelling answers the same error
with its own status code: dynamo.vllm's always HTTP 200 ``{"status": "error"}``,
vLLM's 400 for a bad request and 500 for what the engine refused or failed, the
Dynamo sidecar's 200 for a control's bad body and 500 for the rest. The kind says
which; the message is the same in all three.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from engine_contract.labels import label_problem
from engine_contract.refit_rules import UpdateRefusal, needs_pause, update_refusal
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from rl_client.refit_rpc import RefitRpc

Body = dict[str, Any]


class ErrorKind(enum.Enum):
    """Whose fault an error answer is, which each spelling turns into its status code."""

    # The request itself (a body, a parameter): nothing reached the engine.
    INVALID = "invalid"
    # The engine's rules refuse it now or for good (not paused, out of order, a
    # stale writer, a checkpoint that does not fit, an engine that cannot).
    REFUSED = "refused"
    # The engine server does not implement it (UNIMPLEMENTED).
    UNSUPPORTED = "unsupported"
    # The engine failed, or could not be reached, or ran past a deadline.
    FAILED = "failed"


class ErrorAnswer(ValueError):
    """An answer ``{"status": "error", "message": ...}`` (plus any extra fields);
    ``kind``: the request's fault unless said otherwise."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INVALID, **extra: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


class ErrorBody(dict[str, Any]):
    """An error answer as the routes return it: the dict dynamo.vllm's spelling
    sends as is, carrying its ``kind`` for the spellings that answer with a code."""

    def __init__(self, body: Mapping[str, Any], kind: ErrorKind) -> None:
        super().__init__(body)
        self.kind = kind


# The engine server's status codes by whose fault they are (the rest: FAILED).
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ABORTED,
    }
)


def status_kind(code: grpc.StatusCode) -> ErrorKind:
    """The kind of an engine server's refusal or failure, by its status code."""
    if code in _REFUSALS:
        return ErrorKind.REFUSED
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return ErrorKind.UNSUPPORTED
    return ErrorKind.FAILED


def error_kind(answer: Mapping[str, Any]) -> ErrorKind | None:
    """None for a success; an error answer's kind (FAILED where a handler built
    the error dict itself, as ``liveness_probe`` does for a down engine)."""
    if answer.get("status") != "error":
        return None
    return answer.kind if isinstance(answer, ErrorBody) else ErrorKind.FAILED


def version_label(value: Any) -> str:
    """dynamo.vllm takes any JSON scalar as a version; the engine labels with text,
    which must be printable (``engine_contract.labels``): checked here, before any
    RPC, so a bad label never reaches the engine server or an answer."""
    if value is None or isinstance(value, (dict, list)):
        raise ErrorAnswer(f"'weight_version' must be a string or a number, got {clip(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ErrorAnswer(f"'weight_version' must be a finite number, got {value}")
    label = value if isinstance(value, str) else strict_json(value)
    problem = label_problem(label)
    if problem is not None:
        raise ErrorAnswer(f"'weight_version' {problem}")
    return label


def strict_json(value: Any) -> str:
    """Strict JSON text: a non-finite number is an error, never ``NaN``."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError as e:
        raise ErrorAnswer(f"the body holds a number JSON cannot carry: {e}") from None


def flag(body: Body, key: str, default: bool) -> bool:
    """A boolean of the body (``default`` when absent)."""
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ErrorAnswer(f"'{key}' must be a boolean")
    return value


def updated(body: Body) -> Body:
    """A successful update's answer, as dynamo.vllm gives it: the version the body
    declared (as sent), or "unknown" when it declared none (the label is kept)."""
    return {
        "status": "ok",
        "version": body.get("weight_version", "unknown"),
        "version_declared": "weight_version" in body,
    }


def refuse(refusal: UpdateRefusal | None) -> None:
    """The engine server's own answer to an update the rules refuse, before any RPC."""
    if refusal is not None:
        raise ErrorAnswer(refusal.value, ErrorKind.REFUSED)


async def check_paused(refit: Callable[[], RefitRpc], options: pb.WeightUpdateOptions) -> None:
    """dynamo.vllm's "not paused" answer before anything else of the body; the
    engine server refuses the same (a pause ending meanwhile) in the same words.
    The engine server is asked (``refit``) only when the options need a pause."""
    if needs_pause(options):
        paused = (await refit().is_paused()).paused
        refuse(update_refusal(options, paused=paused))
