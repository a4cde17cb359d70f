"""The one place engine-server failures become Dynamo's exception types.

Dynamo turns ``InvalidArgument`` into HTTP 400 with our message, and migrates a
request to another worker (frontend ``--migration-limit`` > 0) only on
``Disconnected``, ``CannotConnect``, ``ConnectionTimeout`` and
``EngineShutdown``. The contract's retryable codes
(``engine_contract.retry.RETRYABLE_CODES``) land on exactly those, and no
other code does (tests/bridge/test_bridge_errors.py keeps it so): a lost engine
server (UNAVAILABLE: refused, reset, stream broken, draining) is migrated,
never a hang or a 500; a request the engine cannot serve is never sent again.
"""

from __future__ import annotations

import grpc
from dynamo.llm.exceptions import (
    Cancelled,
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    DynamoException,
    EngineShutdown,
    InvalidArgument,
    Unknown,
)

from bridge.codec import RequestError
from bridge.rollout_wire import ProtocolError
from engine_contract.retry import LIMIT_TRAILER

# Every gRPC status code, so a code nobody expected still has a considered answer
# (tests/bridge/test_errors.py checks completeness).
STATUS_TO_DYNAMO: dict[grpc.StatusCode, type[DynamoException]] = {
    # Never raised with OK; listed for completeness.
    grpc.StatusCode.OK: Unknown,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNKNOWN: Unknown,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    # The client's deadline passed; the engine aborted the request. Retryable.
    grpc.StatusCode.DEADLINE_EXCEEDED: ConnectionTimeout,
    grpc.StatusCode.NOT_FOUND: InvalidArgument,
    # A request with this id is still running: the client reused an id.
    grpc.StatusCode.ALREADY_EXISTS: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: Unknown,
    # Over the message size limit: the request is too big, not the server broken.
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,
    # The server refuses this bridge's contract revision (checked at start too):
    # a deployment error no retry mends.
    grpc.StatusCode.FAILED_PRECONDITION: Unknown,
    # The engine server gave up on a stream the bridge did not read (a stalled
    # bridge): another worker may well serve it.
    grpc.StatusCode.ABORTED: Disconnected,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNIMPLEMENTED: Unknown,
    # The engine failed on this request; not retryable.
    grpc.StatusCode.INTERNAL: Unknown,
    # Not ready, draining, died, connection refused or reset: migratable.
    grpc.StatusCode.UNAVAILABLE: Disconnected,
    grpc.StatusCode.DATA_LOSS: Unknown,
    grpc.StatusCode.UNAUTHENTICATED: Unknown,
}


# An engine server at one of its admission limits (RESOURCE_EXHAUSTED naming
# it): another worker, or this one later, may well serve the request.
CAPACITY: type[DynamoException] = Disconnected

# What Dynamo migrates to another worker (frontend --migration-limit > 0).
MIGRATABLE: tuple[type[DynamoException], ...] = (
    Disconnected,
    CannotConnect,
    ConnectionTimeout,
    EngineShutdown,
)


def from_rpc_error(err: grpc.aio.AioRpcError) -> DynamoException:
    """The Dynamo exception for a failed RPC; the engine's message is kept."""
    code = err.code()
    kind = STATUS_TO_DYNAMO.get(code, Unknown)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _limit(err):
        # A capacity refusal, not a request too big: retryable, so migratable.
        kind = CAPACITY
    details = err.details() or ""
    if kind is InvalidArgument:
        # Shown to the HTTP client as is: the engine's message names the field.
        return InvalidArgument(details or code.name)
    return kind(f"engine server: {code.name}: {details}".rstrip(": "))


def _limit(err: grpc.aio.AioRpcError) -> str:
    for key, value in err.trailing_metadata() or ():
        if key == LIMIT_TRAILER:
            return str(value)
    return ""


def to_dynamo(exc: BaseException) -> DynamoException:
    """Any failure on the way to the engine server as a Dynamo exception."""
    if isinstance(exc, DynamoException):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_rpc_error(exc)
    if isinstance(exc, RequestError):
        return InvalidArgument(str(exc))
    if isinstance(exc, ProtocolError):
        return Unknown(f"engine server broke the contract: {exc}")
    if isinstance(exc, grpc.aio.UsageError):
        # The channel is closed: the bridge is shutting down.
        return EngineShutdown(f"bridge is shutting down: {exc}")
    if isinstance(exc, ConnectionError):
        return Disconnected(f"engine server connection lost: {exc}")
    return Unknown(f"{type(exc).__name__}: {exc}")


def stream_ended_early() -> DynamoException:
    """A Generate stream that ended without its last message: the server went away."""
    return Disconnected("engine server ended the stream before the request finished")


def engine_not_serving(address: str) -> DynamoException:
    """The engine server is down or not SERVING (health probe): migratable."""
    return Disconnected(f"engine server at {address} is not serving")


def rollout_timed_out(timeout_s: float | None) -> DynamoException:
    """--rollout-timeout-s passed: the engine request was cancelled (retryable)."""
    return ConnectionTimeout(f"rollout did not finish within {timeout_s:g}s (--rollout-timeout-s)")
