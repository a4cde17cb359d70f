"""Histogram buckets both processes use, so that a request's hops read on one scale
(the bridge's ``bridge_*`` and the engine server's ``engine_server_*`` series)."""

from __future__ import annotations

# Seconds: from a zero-delay rollout (~1 ms) to a long generation (minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Items (answers, KV batches) per stream message: 1 up to the 256 a message holds.
PER_MESSAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
