"""RouterView: this worker's cached blocks as Dynamo's KV router must see them.

A pure state machine, no I/O: it takes the engine server's KV-event batches
(``SubscribeKvEvents`` messages) in order and publishes their effect into
Dynamo's ``KvEventPublisher`` (handed over through ``PushSource``), keeping the
router's view of this worker equal to the engine's cache. ``KvRelay`` feeds it
from the gRPC stream; the one-process benchmark feeds it directly.

- Until the publisher arrives, events are buffered (bounded; on overflow the
  buffer is dropped and a fresh snapshot is asked for once it is there).
- Position: the first subscription asks for a snapshot; after a broken stream
  the relay resumes at ``last sequence + 1`` on the same instance, accepting a
  snapshot if the server cannot replay from there.
- Dynamo 1.6.1's publisher has no clear-all call, so "clear this worker"
  (AllBlocksCleared, or a new engine instance id) is ``publish_removed`` of
  every hash published and not removed.
- Engine hashes are unsigned 64-bit; Dynamo wants signed int64.
- Data-parallel ranks: each batch says its rank, and its events go to that
  rank's publisher only (one ``PushSource`` per rank); a clear clears that
  rank's blocks; a new engine instance clears every rank's.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bridge import metrics
from bridge.dynamo_compat import publishes_cache_salt
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def to_signed(block_hash: int) -> int:
    """The engine's unsigned 64-bit hash as the signed int64 Dynamo expects."""
    return block_hash - _U64 if block_hash > _I64_MAX else block_hash


class KvPublisher(Protocol):
    """What the view needs of Dynamo's ``KvEventPublisher`` (``publish_batch`` optional)."""

    def publish_stored(self, **kwargs: Any) -> Any: ...

    def publish_removed(self, **kwargs: Any) -> Any: ...


class Verdict(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # already seen (a replay overlapping what we had)
    RESYNC = "resync"  # a gap or a stray batch: subscribe again from our position


Event = tuple[int, str, dict[str, Any]]  # (rank, kind, publish kwargs)


class RouterView:
    """Applies KV-event batches in order and publishes them (see the module docs)."""

    def __init__(
        self,
        block_size: int,
        *,
        ranks: int = 1,
        on_instance_change: Callable[[str], None] | None = None,
        on_resync: Callable[[], None] | None = None,
        max_buffered: int = 100_000,
        max_batches_per_message: int = 256,
        max_delay_ms: int = 0,
    ) -> None:
        self.block_size = block_size
        self._on_instance_change = on_instance_change
        # Called when the view needs a fresh subscription (a snapshot) at once.
        self.on_resync = on_resync
        self._max_buffered = max_buffered
        # Several engine batches per stream message: fewer messages to pay for.
        self._max_batches_per_message = max_batches_per_message
        self._max_delay_ms = max_delay_ms
        self.ranks = ranks
        self.instance_id: str | None = None
        self.last_seq: int | None = None
        # Per rank, signed hashes published (or buffered) and not removed since.
        self.known_by_rank: dict[int, set[int]] = {r: set() for r in range(ranks)}
        self._publishers: dict[int, KvPublisher] = {}
        self._pending: list[Event] = []
        # While a batch is applied, its events collect here and go to Dynamo in
        # one publish_batch call (one crossing into Dynamo's runtime per batch).
        self._outbox: list[Event] | None = None
        self._overflowed = False
        self._snapshot_next: int | None = None
        self.batches_applied = 0

    @property
    def known(self) -> set[int]:
        """Every rank's published hashes."""
        return set().union(*self.known_by_rank.values())

    # -- publisher ---------------------------------------------------------

    def set_publisher(self, publisher: KvPublisher, rank: int = 0) -> None:
        self._publishers[rank] = publisher
        mine = [e for e in self._pending if e[0] == rank]
        self._pending = [e for e in self._pending if e[0] != rank]
        self._publish_all(publisher, mine)
        log.info("kv relay: rank %d publisher ready, %d buffered events sent", rank, len(mine))
        if self._overflowed and len(self._publishers) == self.ranks:
            # What overflowed is lost: start over from a snapshot.
            self._overflowed = False
            self.reset_position()
            if self.on_resync is not None:
                self.on_resync()

    def _emit(self, rank: int, kind: str, kwargs: dict[str, Any]) -> None:
        publisher = self._publishers.get(rank)
        if publisher is not None:
            if self._outbox is not None:
                self._outbox.append((rank, kind, kwargs))
            else:
                _publish(publisher, kind, kwargs)
            return
        if self._overflowed:
            return
        self._pending.append((rank, kind, kwargs))
        if len(self._pending) > self._max_buffered:
            log.warning(
                "kv relay: over %d events before the publishers came; dropping them",
                self._max_buffered,
            )
            self._pending.clear()
            for known in self.known_by_rank.values():
                known.clear()
            self._overflowed = True

    @staticmethod
    def _publish_all(publisher: KvPublisher, events: list[Event]) -> None:
        """In order; one ``publish_batch`` call when the publisher has it (Dynamo 1.6.1
        does), else (or if the batch is refused) one call per event."""
        publish_batch = getattr(publisher, "publish_batch", None)
        if publish_batch is not None and len(events) > 1:
            try:
                # The publisher validates the whole list before it enqueues any of it.
                publish_batch([{"type": kind, **kwargs} for _, kind, kwargs in events])
                return
            except Exception:
                log.warning("kv relay: publish_batch failed; publishing one by one", exc_info=True)
        for _, kind, kwargs in events:
            _publish(publisher, kind, kwargs)

    # -- events ------------------------------------------------------------

    def subscription_request(self) -> pb.SubscribeKvEventsRequest:
        """Where to (re)start: a snapshot first, then resume after the last batch."""
        if self.instance_id is None or self.last_seq is None:
            return pb.SubscribeKvEventsRequest(
                include_snapshot=True,
                max_batches_per_message=self._max_batches_per_message,
                max_delay_ms=self._max_delay_ms,
            )
        return pb.SubscribeKvEventsRequest(
            start_sequence_number=self.last_seq + 1,
            snapshot_if_unavailable=True,
            expected_instance_id=self.instance_id,
            max_batches_per_message=self._max_batches_per_message,
            max_delay_ms=self._max_delay_ms,
        )

    def apply_batch(self, batch: pb.KvEventBatch) -> Verdict:
        """Apply one batch in order; say whether to go on, skip, or resubscribe."""
        return self.apply_batches((batch,))

    def apply_message(self, message: pb.SubscribeKvEventsResponse) -> Verdict:
        """A stream message: several batches (``batches``) or one (``batch``)."""
        return self.apply_batches(message.batches if len(message.batches) else (message.batch,))

    def apply_batches(self, batches: Sequence[pb.KvEventBatch]) -> Verdict:
        """Apply batches in order, their events published into Dynamo together;
        RESYNC stops at the batch that needs it."""
        self._outbox = []
        applied = False
        try:
            for batch in batches:
                verdict = self._apply_batch(batch)
                if verdict is Verdict.RESYNC:
                    return verdict
                applied = applied or verdict is Verdict.APPLIED
            return Verdict.APPLIED if applied else Verdict.STALE
        finally:
            outbox, self._outbox = self._outbox, None
            for rank, publisher in self._publishers.items():
                mine = [e for e in outbox or () if e[0] == rank]
                if mine:
                    self._publish_all(publisher, mine)

    def _apply_batch(self, batch: pb.KvEventBatch) -> Verdict:
        if self._overflowed and len(self._publishers) < self.ranks:
            return Verdict.STALE
        if batch.instance_id != self.instance_id:
            self._new_instance(batch.instance_id)
        seq = batch.sequence_number
        if batch.HasField("snapshot"):
            part = batch.snapshot
            if part.index != (0 if self._snapshot_next is None else self._snapshot_next):
                self.reset_position()
                return Verdict.RESYNC
            self._snapshot_next = None if part.last else part.index + 1
        else:
            if self._snapshot_next is not None:
                # A live batch in the middle of a snapshot: start over.
                self.reset_position()
                return Verdict.RESYNC
            if self.last_seq is None:
                if seq != 1:  # history we never saw: take a snapshot instead
                    return Verdict.RESYNC
            elif seq <= self.last_seq:
                return Verdict.STALE
            elif seq != self.last_seq + 1:
                log.warning("kv relay: gap after batch %d (got %d); resuming", self.last_seq, seq)
                return Verdict.RESYNC
        rank = batch.data_parallel_rank
        if 0 <= rank < self.ranks:
            for event in batch.events:
                self._apply_event(rank, event)
        else:
            log.warning(
                "kv relay: a batch of rank %d from an engine of %d ranks; skipped",
                rank,
                self.ranks,
            )
        self.last_seq = seq
        self.batches_applied += 1
        if batch.HasField("snapshot"):
            if self._snapshot_next is None:  # its last part
                metrics.KV_SNAPSHOTS.inc()
        else:
            metrics.KV_BATCHES.inc()
            metrics.KV_EVENTS.inc(len(batch.events))
            if batch.timestamp_unix_nanos:
                metrics.KV_LAG_SECONDS.observe((time.time_ns() - batch.timestamp_unix_nanos) / 1e9)
        return Verdict.APPLIED

    def _apply_event(self, rank: int, event: pb.KvEvent) -> None:
        which = event.WhichOneof("event")
        if which == "stored":
            stored = event.stored
            hashes = [to_signed(h) for h in stored.block_hashes]
            size = stored.block_size or self.block_size
            if not hashes:
                return
            if len(stored.token_ids) != size * len(hashes):
                log.warning(
                    "kv relay: stored event with %d tokens for %d blocks of %d; skipped",
                    len(stored.token_ids),
                    len(hashes),
                    size,
                )
                return
            self.known_by_rank[rank].update(hashes)
            self._emit(
                rank,
                "stored",
                {
                    "token_ids": list(stored.token_ids),
                    "num_block_tokens": [size] * len(hashes),
                    "block_hashes": hashes,
                    "parent_hash": (
                        to_signed(stored.parent_block_hash)
                        if stored.HasField("parent_block_hash")
                        else None
                    ),
                    "lora_name": stored.lora_name or None,
                    **_salt(stored.cache_salt),
                },
            )
        elif which == "removed":
            hashes = [to_signed(h) for h in event.removed.block_hashes]
            if hashes:
                self.known_by_rank[rank].difference_update(hashes)
                self._emit(rank, "removed", {"block_hashes": hashes})
        elif which == "cleared":
            self.clear(rank)

    def clear(self, rank: int | None = None) -> None:
        """Drop this worker's blocks (of one rank, or all) from the router's view
        (no clear-all in Dynamo 1.6.1)."""
        for r in range(self.ranks) if rank is None else (rank,):
            known = self.known_by_rank[r]
            if r not in self._publishers:
                # Nothing reached Dynamo yet: forgetting the buffer is the same thing.
                self._pending = [e for e in self._pending if e[0] != r]
            elif known:
                self._emit(r, "removed", {"block_hashes": sorted(known)})
            known.clear()

    def _new_instance(self, instance_id: str) -> None:
        if self.instance_id is not None:
            log.info(
                "kv relay: engine instance changed %s -> %s; clearing its blocks",
                self.instance_id,
                instance_id,
            )
            self.clear()
        self.instance_id = instance_id
        self.last_seq = None
        self._snapshot_next = None
        if self._on_instance_change is not None:
            self._on_instance_change(instance_id)

    def reset_position(self) -> None:
        self.last_seq = None
        self._snapshot_next = None


def _salt(cache_salt: str) -> dict[str, str]:
    """A salted chain's namespace for the router, where Dynamo takes one (a salt it
    cannot take is left off: its router then counts the chain as unsalted)."""
    return {"cache_salt": cache_salt} if cache_salt and publishes_cache_salt() else {}


def _publish(publisher: KvPublisher, kind: str, kwargs: dict[str, Any]) -> None:
    try:
        if kind == "stored":
            publisher.publish_stored(**kwargs)
        else:
            publisher.publish_removed(**kwargs)
    except Exception:  # one bad event must not end the relay
        log.exception("kv relay: publishing a %s event failed", kind)
