"""The engine's own Prometheus series (vLLM's ``vllm:``) in the worker's ``/metrics``.

dynamo.vllm renders vLLM's registry into its system port's ``/metrics`` with the
worker's labels added (``dynamo_namespace``, ``dynamo_component``,
``dynamo_endpoint``, ``worker_id``, ``model``, ``model_name``; a series' own
labels win), and RL frameworks read them there (NeMo RL's
``DynamoMetricsSampler``: ``vllm:kv_cache_usage_perc``,
``vllm:generation_tokens_total``, ...). Here vLLM runs in the engine server,
local or remote, so each scrape of the bridge's system port asks it
(``GetEngineMetrics``, contract revision 9) under a short deadline and labels
its series with Dynamo's own helper and the labels Dynamo gives the bridge's
series. A slow or dead server costs a scrape at most the deadline: the
scrape then carries the rest without them, and a log line (at most one a minute
while that lasts) says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

# A Prometheus scrape's own timeout is 10 s by default, NeMo RL's its interval + 2 s.
DEFAULT_TIMEOUT_S = 1.0
# While a failure lasts, its log line comes again at most this often.
LOG_EVERY_S = 60.0

Link = Callable[[], tuple[EngineClient | None, pb.GetServerInfoResponse | None]]


class _Parsed(Collector):
    """Families parsed from exposition text, collected as they are."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def labelled(text: str, labels: Mapping[str, str]) -> str:
    """``text``'s families with ``labels`` added to every sample that lacks them,
    rendered as dynamo.vllm renders vLLM's registry (Dynamo's ``gather_with_labels``).
    Raises ValueError on text that is not Prometheus exposition."""
    from dynamo.common.utils.prometheus import gather_with_labels

    families = list(text_string_to_metric_families(text))
    if not families:
        return ""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Parsed(families))
    # Dynamo's helper answers "" on a failure of its own; the text parsed, so
    # that is a rendering bug the caller reports as no series.
    return gather_with_labels(registry, labels)


class EngineSeries:
    """``await text()`` per scrape: the engine's series, labelled, or "" (logged)."""

    def __init__(
        self, link: Link, timeout_s: float = DEFAULT_TIMEOUT_S, log_every_s: float = LOG_EVERY_S
    ) -> None:
        self._link = link
        self.timeout_s = timeout_s
        self.log_every_s = log_every_s
        # The labels of the bridge's own series (Dynamo's auto-labels), once
        # Dynamo hands them over (``BridgeEngine.register_prometheus``).
        self.labels: dict[str, str] = {}
        self._failing: str | None = None
        self._logged_at = 0.0
        self._missed = 0

    async def text(self) -> str:
        client, info = self._link()
        if client is None or info is None:
            self._failed("unlinked", "no engine server connected yet", quiet=True)
            return ""
        try:
            raw = await client.get_engine_metrics(self.timeout_s)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                why = "the engine server does not serve GetEngineMetrics (UNIMPLEMENTED)"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"GetEngineMetrics took over {self.timeout_s:g} s"
            else:
                why = f"GetEngineMetrics failed: {code.name}: {e.details()}"
            self._failed(code.name, why)
            return ""
        except Exception as e:  # a channel closed under a swap, and the like
            self._failed(type(e).__name__, f"GetEngineMetrics failed: {e!r}")
            return ""
        try:
            text = labelled(raw, self.labels)
        except ValueError as e:
            self._failed("unparsable", f"the engine server's metrics are not Prometheus text: {e}")
            return ""
        if self._failing is not None:
            log.info("/metrics: the engine's series are back (%s before)", self._failing)
            self._failing = None
        return text

    def _failed(self, kind: str, why: str, quiet: bool = False) -> None:
        """Log ``why`` when its ``kind`` of failure is new, then at most every
        ``log_every_s`` while it lasts (a scrape every few seconds must not flood)."""
        now = time.monotonic()
        if kind == self._failing and now - self._logged_at < self.log_every_s:
            self._missed += 1
            return
        again = f" ({self._missed} scrapes since the last line)" if kind == self._failing else ""
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "/metrics without the engine's series: %s%s",
            why,
            again,
        )
        self._failing, self._logged_at, self._missed = kind, now, 0
