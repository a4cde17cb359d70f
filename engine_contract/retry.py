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
        # The server gave up on a stream whose client stopped reading.
        grpc.StatusCode.ABORTED,
    }
)


def is_retryable(code: grpc.StatusCode) -> bool:
    return code in RETRYABLE_CODES
