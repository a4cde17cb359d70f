"""Errors the core raises, each tied to the gRPC status the contract gives it."""

from __future__ import annotations

import grpc


class ServerError(Exception):
    """A failure answered with a gRPC status; the message names what is wrong."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(ServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class DuplicateRequest(ServerError):
    code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id: {request_id!r} is already running on this server")


class NotReady(ServerError):
    code = grpc.StatusCode.UNAVAILABLE


class Draining(ServerError):
    code = grpc.StatusCode.UNAVAILABLE


class EngineUnavailable(ServerError):
    code = grpc.StatusCode.UNAVAILABLE


class RevisionRejected(ServerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class KvPositionUnavailable(ServerError):
    code = grpc.StatusCode.OUT_OF_RANGE


class EngineFailed(ServerError):
    code = grpc.StatusCode.INTERNAL


class EngineRejected(ServerError):
    """The engine refused the request's parameters (after our own checks passed)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class StreamStalled(ServerError):
    """The client stopped reading a stream: one write waited past the watchdog."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, timeout_s: float, aborted: str = "the engine request") -> None:
        super().__init__(
            f"client did not read the stream for {timeout_s:g}s (stream write timeout); "
            f"{aborted} was aborted"
        )
