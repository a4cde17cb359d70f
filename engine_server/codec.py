"""Engine outputs to contract messages. Pure functions, no I/O."""

from __future__ import annotations

from engine_contract.tensors import TENSOR_DTYPES
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import FinishReason, RoutedExpertsArray

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def stop_match(stop_reason: int | str | None) -> pb.StopMatch | None:
    if stop_reason is None:
        return None
    if isinstance(stop_reason, str):
        return pb.StopMatch(stop_string=stop_reason)
    return pb.StopMatch(token_id=stop_reason)


def routed_experts(array: RoutedExpertsArray) -> pb.RoutedExperts:
    try:
        dtype = TENSOR_DTYPES[array.dtype]
    except KeyError:
        raise ValueError(f"routed experts dtype {array.dtype!r} has no contract dtype") from None
    return pb.RoutedExperts(data=array.data, dtype=dtype, shape=array.shape)


def r3_stats(array: RoutedExpertsArray | None, prompt_tokens: int, generated: int) -> pb.R3Stats:
    """Router-replay counts: one route per position except the last generated token."""
    expected = max(0, prompt_tokens + generated - 1)
    actual = array.shape[0] if array is not None and array.shape else 0
    return pb.R3Stats(
        actual_routes=actual,
        expected_routes=expected,
        missing_routes=max(0, expected - actual),
        surplus_routes=max(0, actual - expected),
    )
