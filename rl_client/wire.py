"""The rollout's JSON wire form: what the bridge puts in a chunk's ``engine_data``
and the driver reads back from the frontend's ``nvext.engine_data``.

Standard library only, so the bridge (Dynamo side) and the driver (RL side,
without Dynamo) share one definition. The whole result sits under one key,
``engine_data["rollout"]``: the frontend lifts a top-level
``engine_data.routed_experts`` into ``nvext.routed_experts``, and nesting keeps
the result in one piece whatever the frontend does with other keys. An
ordinary chat or completion that asks for ``engine_data`` gets the token bundle
instead (``read_token_bundle``): the keys dynamo.vllm writes and NeMo-Gym reads.

Floats: the rollout's logprobs travel as the base64 of their little-endian
float64 bytes (wire 3), not as JSON numbers: the frontend parses ``engine_data``
into numbers and writes them out again, and Dynamo 1.3.0.post1's frontend parses
some doubles one unit in the last place off (1.6.1's round-trips them). Bytes
pass any frontend unchanged. JSON has no -inf or NaN, so every non-finite logprob
becomes ``LOGPROB_FLOOR`` (NeMo RL's HTTP floor), the one rule for the whole bridge.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_contract.dtypes import TENSOR_DTYPE_BYTES

WIRE_KEY = "rollout"
# 2 added "weight_versions"; 3 carries "logprobs" as float64 bytes (base64) instead
# of JSON numbers. This driver reads all three, but an older driver refuses a newer
# wire (it checks the version exactly): upgrade drivers with bridges.
WIRE_VERSION = 3
READABLE_WIRE_VERSIONS = frozenset({1, 2, 3})

# The finish reason of a rollout that named the weight version it requires and
# was ended because the weights changed under it (contract revision 8): the
# tokens so far, every one of that version.
WEIGHT_VERSION_CHANGED = "weight_version_changed"

# A version-guarded rollout a worker refused, answered as such (not as an error,
# whose text no frontend passes on): ``engine_data[REFUSAL_KEY]`` instead of the
# result, naming the version the rollout requires, the one the worker serves and
# the fleet's committed one, and whether sending it again may help
# (``WeightVersionRefusal``).
REFUSAL_KEY = "weight_version_refused"
REFUSAL_KEYS = frozenset(
    {"required", "serving", "committed", "retryable", "message", "request_id", "instance_id"}
)

# What a non-finite logprob (-inf, +inf, NaN) becomes on the wire.
LOGPROB_FLOOR = -9999.0

# Element sizes of the routed-experts dtypes the contract allows (numpy names).
DTYPE_ITEMSIZE: dict[str, int] = {
    name: TENSOR_DTYPE_BYTES[name]
    for name in ("uint8", "int8", "uint16", "int16", "int32", "int64")
}

R3_KEYS = ("actual_routes", "expected_routes", "missing_routes", "surplus_routes")
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")

# Every key of the wire object; the driver rejects anything else.
WIRE_KEYS = frozenset(
    {
        "version",
        "request_id",
        "instance_id",
        "token_ids",
        "logprobs",
        "truncated",
        "finish_reason",
        "stop_reason",
        "usage",
        "routed_experts",
        "r3_stats",
        "weight_versions",
    }
)


# A completion's token bundle in ``engine_data`` (a chat or completion request whose
# ``nvext.extra_fields`` names "engine_data"): dynamo.vllm's keys, which NeMo-Gym
# reads for training instead of the OpenAI choice (whose logprobs the frontend may
# trim, e.g. at EOS). ``finished``: the engine ended it by a stop or length.
PROMPT_TOKEN_IDS = "prompt_token_ids"
COMPLETION_TOKEN_IDS = "completion_token_ids"
COMPLETION_LOGPROBS = "completion_logprobs"
FINISHED = "finished"


class WireError(ValueError):
    """The wire object is malformed (a bridge/driver version mismatch or a bug)."""


@dataclass(frozen=True)
class TokenBundle:
    """What the engine saw and made: its prompt, its tokens and their sampled logprobs."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finished: bool | None


@dataclass(frozen=True)
class WeightVersionRefusal:
    """A worker's refusal of a rollout held to a weight version, with what the fleet
    serves: ``required`` (the rollout's version), ``serving`` (the refusing worker's),
    ``committed`` (the fleet's committed record's). ``retryable``: a refit is under
    way on that worker, which may bring ``required``; otherwise the fleet has moved
    on from it and no worker will serve it again. ``message`` says it in words."""

    required: str
    serving: str
    committed: str
    retryable: bool
    message: str
    request_id: str = ""
    instance_id: str = ""


def encode_refusal(refusal: WeightVersionRefusal) -> dict[str, Any]:
    return {
        "required": refusal.required,
        "serving": refusal.serving,
        "committed": refusal.committed,
        "retryable": refusal.retryable,
        "message": refusal.message,
        "request_id": refusal.request_id,
        "instance_id": refusal.instance_id,
    }


def decode_refusal(obj: Any) -> WeightVersionRefusal:
    """Inverse of ``encode_refusal``; WireError when malformed."""
    if not isinstance(obj, Mapping):
        raise WireError(f"engine_data.{REFUSAL_KEY} is not an object")
    unknown = sorted(set(obj) - REFUSAL_KEYS)
    if unknown:
        raise WireError(f"engine_data.{REFUSAL_KEY} has unknown keys {unknown}")
    texts = ("required", "serving", "committed", "message", "request_id", "instance_id")
    if not all(isinstance(obj.get(k, ""), str) for k in texts):
        raise WireError(f"engine_data.{REFUSAL_KEY}: {list(texts)} must be strings")
    missing = [k for k in ("required", "serving", "committed", "retryable") if k not in obj]
    if missing or not isinstance(obj["retryable"], bool):
        raise WireError(
            f"engine_data.{REFUSAL_KEY} lacks {missing} or its 'retryable' is not a boolean"
        )
    return WeightVersionRefusal(
        required=obj["required"],
        serving=obj["serving"],
        committed=obj["committed"],
        retryable=obj["retryable"],
        message=obj.get("message", ""),
        request_id=obj.get("request_id", ""),
        instance_id=obj.get("instance_id", ""),
    )


def read_token_bundle(engine_data: Mapping[str, Any]) -> TokenBundle:
    """The bundle in an answer's ``nvext.engine_data``, checked as NeMo-Gym checks it
    (all three lists present, logprobs one per completion token): a partial or
    misaligned bundle must fail here, not shift every later logprob in training."""
    keys = (PROMPT_TOKEN_IDS, COMPLETION_TOKEN_IDS, COMPLETION_LOGPROBS)
    missing = [k for k in keys if not isinstance(engine_data.get(k), list)]
    if missing:
        raise WireError(f"engine_data lacks the token bundle's {missing}")
    prompt, completion = engine_data[PROMPT_TOKEN_IDS], engine_data[COMPLETION_TOKEN_IDS]
    logprobs = engine_data[COMPLETION_LOGPROBS]
    if not all(type(t) is int for t in (*prompt, *completion)):
        raise WireError("engine_data token ids must be integers")
    if not all(type(x) in (int, float) for x in logprobs):
        raise WireError("engine_data completion_logprobs must be numbers")
    if len(logprobs) != len(completion):
        raise WireError(
            f"engine_data has {len(logprobs)} completion_logprobs for "
            f"{len(completion)} completion_token_ids"
        )
    finished = engine_data.get(FINISHED)
    return TokenBundle(
        list(prompt),
        list(completion),
        [float(x) for x in logprobs],
        finished if isinstance(finished, bool) else None,
    )


def finite_logprob(value: float) -> float:
    """Finite values unchanged (bit for bit); anything else the floor."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def finite_logprobs(values: Iterable[float]) -> list[float]:
    return [v if math.isfinite(v) else LOGPROB_FLOOR for v in values]


def encode_logprobs(values: Iterable[float]) -> str:
    """Logprobs (non-finite ones floored) as the base64 of little-endian float64 bytes."""
    floored = finite_logprobs(values)
    return base64.b64encode(struct.pack(f"<{len(floored)}d", *floored)).decode("ascii")


def decode_logprobs(value: Any, version: int) -> list[float]:
    """A wire object's ``logprobs``: float64 bytes from wire 3, numbers before it."""
    if version < 3:
        return [float(x) for x in value]
    if not isinstance(value, str):
        raise WireError("rollout 'logprobs' must be base64 float64 bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as e:
        raise WireError(f"rollout 'logprobs' is not base64: {e}") from e
    if len(raw) % 8:
        raise WireError(f"rollout 'logprobs' holds {len(raw)} bytes, not whole float64s")
    return list(struct.unpack(f"<{len(raw) // 8}d", raw))


def encode_routed_experts(data: bytes, dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    """``{dtype, shape, data}`` with ``data`` the base64 of row-major little-endian bytes."""
    check_routed_experts(len(data), dtype, shape)
    return {"dtype": dtype, "shape": list(shape), "data": base64.b64encode(data).decode("ascii")}


def decode_routed_experts(obj: Mapping[str, Any]) -> tuple[bytes, str, tuple[int, ...]]:
    """Inverse of ``encode_routed_experts``; checks the size against dtype and shape."""
    try:
        dtype = obj["dtype"]
        shape = tuple(int(d) for d in obj["shape"])
        data = base64.b64decode(obj["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed routed_experts: {e}") from e
    check_routed_experts(len(data), dtype, shape)
    return data, dtype, shape


def check_routed_experts(nbytes: int, dtype: str, shape: Sequence[int]) -> None:
    if dtype not in DTYPE_ITEMSIZE:
        raise WireError(f"routed_experts dtype {dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
    if any(d < 0 for d in shape):
        raise WireError(f"routed_experts shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if nbytes != expected:
        raise WireError(
            f"routed_experts holds {nbytes} bytes, shape {list(shape)} of {dtype} needs {expected}"
        )


def encode_weight_versions(spans: Iterable[Any]) -> list[dict[str, Any]]:
    """Contract WeightVersionSpans as ``[{version, start, end}, ...]``."""
    return [{"version": s.version, "start": s.start, "end": s.end} for s in spans]


def decode_weight_versions(value: Any, tokens: int) -> list[tuple[str, int, int]]:
    """Inverse of ``encode_weight_versions``: spans that tile ``[0, tokens)`` in order."""
    if not isinstance(value, list):
        raise WireError("weight_versions must be a list")
    spans: list[tuple[str, int, int]] = []
    for item in value:
        try:
            span = (str(item["version"]), int(item["start"]), int(item["end"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"malformed weight_versions entry {item!r}") from e
        if span[1] != (spans[-1][2] if spans else 0) or span[2] < span[1]:
            raise WireError(f"weight_versions spans do not tile the tokens: {value!r}")
        spans.append(span)
    if spans and spans[-1][2] != tokens:
        raise WireError(f"weight_versions end at {spans[-1][2]}, the rollout has {tokens} tokens")
    return spans
