"""Part 4 of ``make bench``: the bridge, with Dynamo's KV publisher timed.

``python -m bench.kv_worker STATS_DIR <bridge flags>``. The real bridge and
relay; the real ``KvEventPublisher`` wrapped so that each stored block's
arrival is timed against the emission time its hash carries (see
``bench/kv_source.py``). Writing ``STATS_DIR/request`` (holding an index)
makes it write ``STATS_DIR/stats.json``: counts, and the latencies from that
index on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.run import run

from bridge.engine import BridgeEngine


class TimedPublisher:
    def __init__(self, inner: Any, stats_dir: Path) -> None:
        self.inner = inner
        self.stats_dir = stats_dir
        self.latency_ns = array("q")
        self.events = 0
        self.hashes: set[int] = set()
        self.duplicates = 0
        self.errors = 0
        threading.Thread(target=self._dump_loop, daemon=True).start()

    def _stored(self, block_hashes: Iterable[int], now: int) -> None:
        """Count one stored event, published alone or in a batch alike: each
        block's latency (a hash is its emission time in ns: bench/kv_source.py)
        and the hashes seen before."""
        for h in block_hashes:
            self.latency_ns.append(now - h)
            if h in self.hashes:
                self.duplicates += 1
            self.hashes.add(h)
        self.events += 1

    def publish_stored(self, **kwargs: Any) -> None:
        self._stored(kwargs["block_hashes"], time.time_ns())
        self.inner.publish_stored(**kwargs)

    def publish_removed(self, **kwargs: Any) -> None:
        self.inner.publish_removed(**kwargs)

    def publish_batch(self, events: Any) -> None:
        now = time.time_ns()
        for event in events:
            if event.get("type") == "stored":
                self._stored(event["block_hashes"], now)
        self.inner.publish_batch(events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _dump_loop(self) -> None:
        request = self.stats_dir / "request"
        while True:
            time.sleep(0.02)
            if not request.exists():
                continue
            start = int(request.read_text().strip() or 0)
            lat = self.latency_ns[start:]
            stats = {
                "blocks": len(self.latency_ns),
                "unique": len(self.hashes),
                "duplicates": self.duplicates,
                "events": self.events,
                "latency_ns": list(lat),
            }
            tmp = self.stats_dir / "stats.json.tmp"
            tmp.write_text(json.dumps(stats))
            os.replace(tmp, self.stats_dir / "stats.json")
            request.unlink()


class TimedBridge(BridgeEngine):
    stats_dir = Path(".")

    async def kv_event_sources(self) -> list[KvEventSource]:
        sources = await super().kv_event_sources()
        relay = self._relay
        if relay is None:
            return sources

        def on_ready(publisher: Any) -> None:
            relay.on_ready(TimedPublisher(publisher, self.stats_dir))

        return [PushSource(on_ready=on_ready, dp_rank=0)]


def main() -> int:
    TimedBridge.stats_dir = Path(sys.argv[1])
    run(TimedBridge, sys.argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
