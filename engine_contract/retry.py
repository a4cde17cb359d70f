"""Which status codes mean "the same request may succeed if sent again".

The one list both processes and the driver follow: the proto's header comment
says the same in words (a test compares them), the bridge turns exactly these
into Dynamo's migratable errors, and the driver retries the HTTP statuses they
become. Every other code is the request's own fault or a failure that would
repeat.
"""

from __future__ import annotations

import grpc

RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset(
    {
        # Not ready, draining, died, connection lost: another server, or later.
        grpc.StatusCode.UNAVAILABLE,
        # The client's deadline passed; nothing says the next try would be slow.
        grpc.StatusCode.DEADLINE_EXCEEDED,
        # The server gave up on a stream whose client stopped reading, a pause
        # ended the request, or (revision 8) a version-guarded request met weights
        # of another version: later, or on another server.
        grpc.StatusCode.ABORTED,
    }
)


# RESOURCE_EXHAUSTED is retryable exactly when it names the admission limit that
# refused the request: in this trailing-metadata key of a failed call, or in
# RolloutError.limit on a Rollouts stream. Without it, the message was over the
# size limit, and sending it again fails again.
LIMIT_TRAILER = "engine-contract-limit"


# The one deliberate difference, on the driver's side. The driver sees only HTTP,
# and Dynamo's frontend answers 500 both for an engine failure this rule calls
# final (INTERNAL, FAILED_PRECONDITION, UNKNOWN...: the bridge raises them as
# Dynamo's Unknown) and for failures of its own that pass; NeMo RL's Dynamo
# driver retries every 5xx, and so does ours (rl_client.driver.RETRYABLE_STATUSES).
# A final failure then costs at most RetryPolicy.attempts - 1 more tries, never a
# wrong answer. Everything retryable here reaches the driver as a status it
# retries (503 once the frontend's migrations are spent), and a request's own
# fault (INVALID_ARGUMENT and its kin: 400) is never retried.
HTTP_RETRIED_BEYOND_THE_RULE: frozenset[int] = frozenset({500})


def is_retryable(code: grpc.StatusCode, limit: str = "") -> bool:
    """Whether the same request may succeed if sent again (``limit``: the admission
    limit a RESOURCE_EXHAUSTED named, if any)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return bool(limit)
    return code in RETRYABLE_CODES
