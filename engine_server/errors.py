"""Errors the core raises, each tied to the gRPC status the contract gives it."""

from __future__ import annotations

import grpc

from engine_contract.refit_rules import UpdateRefusal
from engine_contract.text import clip


class ServerError(Exception):
    """A failure answered with a gRPC status; the message names what is wrong."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # The admission limit that refused the request (CapacityExceeded only).
    limit: str = ""


class InvalidRequest(ServerError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class DuplicateRequest(ServerError):
    code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id: {clip(request_id)} is already running on this server")


class CapacityExceeded(ServerError):
    """An admission limit is reached: retryable (later, or on another server)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, limit: str, value: int, what: str) -> None:
        super().__init__(f"{limit}: {what} (limit {value}); try again later or on another server")
        self.limit = limit


class NotReady(ServerError):
    """The engine is still starting: retryable here, shortly."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(ServerError):
    """The server is shutting down and takes nothing new: retryable elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineUnavailable(ServerError):
    """The engine died, or a failed refit left it broken: retryable elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class RevisionRejected(ServerError):
    """The client states a contract revision older than this server accepts."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class KvPositionUnavailable(ServerError):
    """A KV subscription asked for a position this server no longer holds."""

    code = grpc.StatusCode.OUT_OF_RANGE


class EngineFailed(ServerError):
    """The engine broke its side of the contract (no final output, misaligned logprobs)."""

    code = grpc.StatusCode.INTERNAL


class EngineRejected(ServerError):
    """The engine refused the request's parameters (after our own checks passed)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class AbortedByPause(ServerError):
    """The request was ended by PauseGeneration(ABORT) (or Sleep): retryable."""

    code = grpc.StatusCode.ABORTED

    def __init__(self) -> None:
        super().__init__(
            "aborted by PauseGeneration(ABORT) for a weight update; no partial result is "
            "returned: send it again (it runs after ResumeGeneration, on the new weights)"
        )


class WeightVersionMismatch(ServerError):
    """A version-guarded request (``required_weight_version``) that the weights here
    cannot serve: nothing of it is returned. ABORTED, the code for a test-and-set
    that failed: retryable at a higher level, later (a refit under way) or on a
    server that serves the version, where FAILED_PRECONDITION would say "not until
    someone fixes the state" and UNAVAILABLE "this server is down". The message
    begins with the field's name: the bridge tells the refusal by it
    (``bridge.weight_refusal.GUARD_REFUSAL_PREFIX``) and judges it against the
    fleet's committed record."""

    code = grpc.StatusCode.ABORTED

    def __init__(
        self,
        required: str,
        serving: str,
        *,
        engine_changed: bool = False,
        mixed: str | None = None,
    ) -> None:
        if engine_changed:
            what = (
                f"the engine's weights became {clip(serving)} under it (not through this "
                "server's refit calls); nothing of it is returned"
            )
        elif mixed is not None:
            what = (
                f"this server's weights, labelled {clip(serving)}, are not one version "
                f"whole: {mixed}; nothing was generated"
            )
        else:
            what = f"this server serves {clip(serving)}; nothing was generated"
        super().__init__(
            f"required_weight_version: the request requires weight version {clip(required)}, "
            f"{what}: send it again later or to a server serving that version"
        )
        self.required = required
        self.serving = serving


class RefitRefused(ServerError):
    """A refit step the engine cannot do now, or at all (the message says which)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleWriter(RefitRefused):
    """A weight or label change fenced on a count of changes the engine has moved
    past (contract revision 10): another writer came first; nothing changed."""


# The refit rules' refusals (engine_contract.refit_rules): each message is the
# answer the RL routes give, in dynamo.vllm's words; the bridge passes it on.


class NotPaused(RefitRefused):
    """A weight update while generation runs (and not ``allow_unpaused``)."""

    def __init__(self) -> None:
        super().__init__(UpdateRefusal.NOT_PAUSED.value)


class UnpausedCacheReset(ServerError):
    """An ``allow_unpaused`` update that asks for a prefix-cache reset (running
    requests hold the cache): refused whatever the state."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self) -> None:
        super().__init__(UpdateRefusal.UNPAUSED_CACHE_RESET.value)


UPDATE_REFUSALS: dict[UpdateRefusal, type[ServerError]] = {
    UpdateRefusal.NOT_PAUSED: NotPaused,
    UpdateRefusal.UNPAUSED_CACHE_RESET: UnpausedCacheReset,
}


class StreamStalled(ServerError):
    """The client stopped reading a stream: one write waited past the watchdog."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, timeout_s: float, aborted: str = "the engine request") -> None:
        super().__init__(
            f"client did not read the stream for {timeout_s:g}s (stream write timeout); "
            f"{aborted} was aborted"
        )


class UpdateStalled(ServerError):
    """A streamed weight update went silent past the watchdog (nothing loaded)."""

    code = grpc.StatusCode.ABORTED


class RefitTimedOut(ServerError):
    """A refit step ran past the server's refit deadline before anything loaded
    (the message says which deadline and flag): the old weights still serve, and
    the same call may succeed later."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TransferUnavailable(ServerError):
    """The weight-transfer peer (a trainer's group) cannot be reached, or an earlier
    transfer step is still stuck in the engine: nothing was loaded, the old weights
    still serve; retryable once the trainer (or the stuck step) is back."""

    code = grpc.StatusCode.UNAVAILABLE


class UpdateAbandoned(TransferUnavailable):
    """A weight-transfer update ended before its finish (its trainer went away, a
    round failed) and was rolled back: the old weights serve, no update is in
    progress; the trainer inits its group again and starts over."""


class WeightsPathDenied(ServerError):
    """A weight update's path lies outside the folders the server may load from
    (--weights-allowed-dir): the caller lacks the right, the request is well formed."""

    code = grpc.StatusCode.PERMISSION_DENIED
