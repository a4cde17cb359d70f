"""Engine-server failures -> Dynamo exception types."""

from __future__ import annotations

import grpc
import pytest
from dynamo.llm.exceptions import (
    Cancelled,
    Disconnected,
    InvalidArgument,
    Unknown,
)

from bridge import errors
from bridge.codec import RequestError
from bridge.rollout_wire import ProtocolError
from engine_contract.retry import HTTP_RETRIED_BEYOND_THE_RULE, RETRYABLE_CODES
from rl_client.driver import RETRYABLE_STATUSES

MIGRATABLE = errors.MIGRATABLE


def rpc_error(code: grpc.StatusCode, details: str = "boom") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_every_status_code_has_a_mapping() -> None:
    assert set(errors.STATUS_TO_DYNAMO) == set(grpc.StatusCode)


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_code_maps_to_a_dynamo_exception(code: grpc.StatusCode) -> None:
    exc = errors.from_rpc_error(rpc_error(code))
    assert isinstance(exc, errors.STATUS_TO_DYNAMO[code])


def test_invalid_argument_keeps_the_engine_message() -> None:
    exc = errors.from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"))
    assert isinstance(exc, InvalidArgument) and str(exc) == "prompt too long"


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_exactly_the_retryable_codes_are_migrated(code: grpc.StatusCode) -> None:
    """The bridge's half of the one retry rule (engine_contract.retry)."""
    migrated = issubclass(errors.STATUS_TO_DYNAMO[code], MIGRATABLE)
    assert migrated == (code in RETRYABLE_CODES), code


# What Dynamo 1.6.1's frontend answers for each exception the bridge raises once
# no migration is left (503: tests/e2e/test_e2e_refit.py's ABORT pause and
# tests/faults/test_faults_capacity.py see it; 400: the e2e bad-input tests; 500:
# its answer for any other worker error).
FRONTEND_STATUS = {Disconnected: 503, InvalidArgument: 400, Unknown: 500}


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_the_driver_retries_what_the_rule_retries_and_one_listed_difference(
    code: grpc.StatusCode,
) -> None:
    """The driver's half of the one retry rule, with its one listed difference."""
    status = FRONTEND_STATUS.get(errors.STATUS_TO_DYNAMO[code])
    if status is None:
        return  # Cancelled (the driver's RolloutCancelledError), ConnectionTimeout
    if code in RETRYABLE_CODES:
        assert status in RETRYABLE_STATUSES, code
    elif status in RETRYABLE_STATUSES:
        assert status in HTTP_RETRIED_BEYOND_THE_RULE, code
    assert 400 not in RETRYABLE_STATUSES


def test_lost_engine_server_is_migratable() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert isinstance(errors.from_rpc_error(rpc_error(code)), MIGRATABLE)
    assert isinstance(errors.to_dynamo(ConnectionResetError("reset")), MIGRATABLE)
    assert isinstance(errors.to_dynamo(grpc.aio.UsageError("closed")), MIGRATABLE)


def test_other_failures_map_to_dynamo_errors_keeping_their_cause() -> None:
    assert isinstance(errors.to_dynamo(RequestError("bad")), InvalidArgument)
    assert isinstance(errors.to_dynamo(ProtocolError("odd")), Unknown)
    assert isinstance(errors.to_dynamo(RuntimeError("x")), Unknown)
    assert isinstance(errors.from_rpc_error(rpc_error(grpc.StatusCode.CANCELLED)), Cancelled)
    same = Disconnected("gone")
    assert errors.to_dynamo(same) is same
    msg = str(errors.from_rpc_error(rpc_error(grpc.StatusCode.INTERNAL, "engine failed")))
    assert "INTERNAL" in msg and "engine failed" in msg
