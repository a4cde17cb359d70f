"""A rollout's result as the JSON the driver reassembles (``rl_client.wire``: the
driver reads what this writes), and the engine's values both kinds of chunk
carry (routed experts, the stop that matched). Pure: no I/O, no Dynamo.

``ProtocolError`` lives here, the lowest module that raises it (``bridge.codec``
raises it too).
"""

from __future__ import annotations

from typing import Any

from engine_contract.v1 import engine_pb2 as pb
from rl_client import wire

# The engine's own names, as the rollout wire form carries them.
_WIRE_FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "aborted",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_WEIGHT_VERSION_CHANGED: wire.WEIGHT_VERSION_CHANGED,
}
_DTYPES: dict[int, str] = {
    pb.TENSOR_DTYPE_UINT8: "uint8",
    pb.TENSOR_DTYPE_INT8: "int8",
    pb.TENSOR_DTYPE_UINT16: "uint16",
    pb.TENSOR_DTYPE_INT16: "int16",
    pb.TENSOR_DTYPE_INT32: "int32",
    pb.TENSOR_DTYPE_INT64: "int64",
}


class ProtocolError(RuntimeError):
    """The engine server broke the contract (misaligned lists, unknown dtype)."""


def rollout_wire(resp: pb.RolloutResponse) -> dict[str, Any]:
    """The whole rollout result as the JSON object the driver reassembles."""
    if len(resp.logprobs) != len(resp.token_ids):
        raise ProtocolError(
            f"rollout {resp.request_id}: {len(resp.logprobs)} logprobs for "
            f"{len(resp.token_ids)} tokens"
        )
    out: dict[str, Any] = {
        "version": wire.WIRE_VERSION,
        "request_id": resp.request_id,
        "instance_id": resp.instance_id,
        "token_ids": list(resp.token_ids),
        "logprobs": wire.encode_logprobs(resp.logprobs),
        "truncated": resp.truncated,
        "finish_reason": _WIRE_FINISH_REASONS.get(resp.finish_reason, "error"),
        "stop_reason": stop_reason(resp.matched_stop),
        "usage": {
            "prompt_tokens": resp.usage.prompt_tokens,
            "completion_tokens": resp.usage.completion_tokens,
            "cached_prompt_tokens": resp.usage.cached_prompt_tokens,
        },
        "routed_experts": None,
        "r3_stats": None,
        "weight_versions": wire.encode_weight_versions(resp.weight_versions),
    }
    if resp.HasField("routed_experts"):
        out["routed_experts"] = routed_experts_wire(resp.routed_experts)
    if resp.HasField("r3_stats"):
        out["r3_stats"] = {k: getattr(resp.r3_stats, k) for k in wire.R3_KEYS}
    return out


def routed_experts_wire(msg: pb.RoutedExperts) -> dict[str, Any]:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ProtocolError(f"routed experts with unknown dtype {msg.dtype}")
    try:
        return wire.encode_routed_experts(msg.data, dtype, list(msg.shape))
    except wire.WireError as e:
        raise ProtocolError(str(e)) from e


def stop_reason(match: pb.StopMatch) -> int | str | None:
    """The stop token id or stop string that ended the request, if any."""
    which = match.WhichOneof("match")
    return None if which is None else getattr(match, which)
