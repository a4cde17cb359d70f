"""The bridge's Prometheus metrics, served inside Dynamo's worker ``/metrics``.

They live in a registry of their own (not prometheus_client's default one, which
Dynamo may bridge for an engine's vendor metrics): ``BridgeEngine.register_prometheus``
hands it to Dynamo (``register_engine_registry``), which renders it on the
system port with its auto-labels (namespace, component, endpoint, model) added.
Hot paths touch pre-bound children only, never per token; the engine server's
identity is read at scrape time.

No Dynamo import here: the module is also what the bridge's unit tests read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_contract.metric_buckets import LATENCY_BUCKETS, PER_MESSAGE_BUCKETS

REGISTRY = CollectorRegistry(auto_describe=True)
# No ``*_created`` series (they would double what Dynamo renders per scrape).
disable_created_metrics()

# From the engine's emit to Dynamo's publisher: sub-millisecond up to a stalled relay.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

HOP_SECONDS = Histogram(
    "bridge_engine_request_duration_seconds",
    "The gRPC hop: from handing a request to the engine server until its answer "
    "(rollout) or last delta (completion), as the bridge sees it",
    ["kind", "transport"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
RECONNECTS = Counter(
    "bridge_engine_reconnects",
    "Times the engine server answered again after the bridge saw it down",
    registry=REGISTRY,
)
INSTANCE_CHANGES = Counter(
    "bridge_engine_instance_changes",
    "Times a new engine server instance was seen at the bridge's address (a restart, a swap)",
    registry=REGISTRY,
)
STREAMS_OPENED = Counter(
    "bridge_engine_streams_opened",
    "Multiplexed streams (Rollouts, Generates) opened to the engine server",
    ["stream"],
    registry=REGISTRY,
)
STREAMS_OPEN = Gauge(
    "bridge_engine_streams_open",
    "Multiplexed streams open to the engine server now",
    ["stream"],
    registry=REGISTRY,
)
STREAM_ITEMS_PER_MESSAGE = Histogram(
    "bridge_engine_stream_items_per_message",
    "Requests multiplexed per stream message: starts per message sent, answers or "
    "deltas per message received",
    ["stream", "direction"],
    buckets=PER_MESSAGE_BUCKETS,
    registry=REGISTRY,
)
KV_EVENTS = Counter(
    "bridge_kv_events_relayed",
    "Live KV events from the engine server applied and handed to Dynamo's publisher "
    "(snapshots apart)",
    registry=REGISTRY,
)
KV_BATCHES = Counter(
    "bridge_kv_batches_relayed", "Live KV-event batches applied (snapshots apart)",
    registry=REGISTRY,
)  # fmt: skip
KV_LAG_SECONDS = Histogram(
    "bridge_kv_relay_lag_seconds",
    "From the engine's emit of a live KV-event batch (its timestamp) to handing it to "
    "Dynamo's publisher (wall clocks: the engine server's host and this one)",
    buckets=LAG_BUCKETS,
    registry=REGISTRY,
)
KV_RESUBSCRIPTIONS = Counter(
    "bridge_kv_resubscriptions",
    "KV-event subscriptions opened again (a broken stream, a gap, a new instance)",
    registry=REGISTRY,
)
KV_SNAPSHOTS = Counter(
    "bridge_kv_snapshots_applied",
    "KV snapshots applied whole (a first subscription, or a resync)",
    registry=REGISTRY,
)

# A catch-up: from a checkpoint's milliseconds to a trainer's step.
CATCH_UP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
CATCH_UP_SECONDS = Histogram(
    "bridge_catch_up_seconds",
    "How long the worker stayed out of the router's pool (at the bridge's start, or after "
    "an engine server restart) until its engine served the fleet's committed weights, by "
    "where they come from (checkpoint: loaded by the bridge; pushed: by the trainer's "
    "keeper); only with a committed record",
    ["source"],
    buckets=CATCH_UP_BUCKETS,
    registry=REGISTRY,
)
CATCHING_UP = Gauge(
    "bridge_catching_up",
    "1 while the worker stays out of the router's pool until its engine serves the "
    "committed weights",
    registry=REGISTRY,
)


class Hop:
    """One kind and transport's latency child; ``observe(started)`` per request."""

    def __init__(self, kind: str, transport: str) -> None:
        self._child = HOP_SECONDS.labels(kind, transport)

    def observe(self, started: float) -> None:
        self._child.observe(time.perf_counter() - started)


HOPS = {
    (kind, stream): Hop(kind, "stream" if stream else "unary")
    for kind in ("rollout", "completion")
    for stream in (True, False)
}


class EngineServerCollector(Collector):
    """``bridge_engine_server_info``: the engine server this bridge serves now."""

    def __init__(self, describe: Callable[[], tuple[str, str, str]]) -> None:
        # () -> (address, instance id, backend)
        self._describe = describe

    def collect(self) -> Iterable[Metric]:
        address, instance_id, backend = self._describe()
        info = InfoMetricFamily("bridge_engine_server", "The engine server the bridge forwards to")
        info.add_metric([], {"address": address, "instance_id": instance_id, "backend": backend})
        yield info

    def describe(self) -> Iterable[Metric]:
        return []
