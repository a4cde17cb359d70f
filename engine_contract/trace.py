"""What a request's W3C trace context may carry across the hop, shared by both sides.

A stream start carries ``traceparent`` and ``tracestate`` in its ``trace_context``
(revision 5), as a unary call carries them in its metadata. Trace context is
advisory: an entry over the bound is dropped (the bridge does not send it, the
server does not keep it), never a reason to fail the request. The bound keeps
both entries of a unary call within gRPC's default metadata limit (8 KiB in
all), so that the two transports carry the same trace context.
"""

from __future__ import annotations

from collections.abc import Mapping

# The keys a stream start's trace_context carries; others are ignored.
TRACE_CONTEXT_KEYS = ("traceparent", "tracestate")
# Characters of one value: 8 times what W3C asks every vendor to pass on (512).
MAX_TRACE_VALUE_CHARS = 4096


def trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C entries of ``headers`` within the bound (empty: none)."""
    kept: dict[str, str] = {}
    for key in TRACE_CONTEXT_KEYS:
        value = headers.get(key)
        if value and len(value) <= MAX_TRACE_VALUE_CHARS:
            kept[key] = value
    return kept
