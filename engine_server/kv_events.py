"""KV-event fan-out: sequence numbers, a bounded replay buffer, and a block mirror.

The backend hands over engine batches in order; the hub numbers them (from 1,
contiguous, per instance), encodes each once, keeps the last N for subscribers
that resume, and applies them to a mirror of the cached blocks (one per
data-parallel rank) so that a subscriber can start from a snapshot.
Subscribers read the shared buffer at their own cursor: no per-subscriber
queues; if one falls out of the buffer it gets a snapshot (when it allowed
one) or a clear error, never a silent gap.

Snapshots cost no copy per subscriber either: the mirrors' blocks in order are
listed once per sequence number and shared by every subscriber that starts
there (lists of references to immutable blocks), and their messages are
encoded one part at a time, on first use, and shared by the subscribers that
start there, yielding to the event loop between parts. What a subscriber that
stops reading still holds is bounded by the server's stream write watchdog
(the servicer ends such calls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass

from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from engine_server import metrics
from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)
from engine_server.errors import KvPositionUnavailable

log = logging.getLogger(__name__)

# Caps on what a subscriber may ask for (SubscribeKvEventsRequest).
MAX_BATCHES_PER_MESSAGE = 1024
MAX_DELAY_MS = 100


@dataclass(frozen=True)
class CachedBlock:
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str
    cache_salt: str = ""


class BlockMirror:
    """The set of blocks the engine holds, rebuilt from its events."""

    def __init__(self) -> None:
        self.blocks: dict[int, CachedBlock] = {}
        # Events that did not fit the mirror (a removal of an unknown hash):
        # a sign the engine's stream and ours disagree. Tests assert it stays 0.
        self.inconsistencies = 0

    def apply(self, events: Iterable[object]) -> None:
        blocks = self.blocks
        for event in events:
            if isinstance(event, BlockStored):
                size = event.block_size
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    blocks[block_hash] = CachedBlock(
                        parent,
                        tuple(event.token_ids[i * size : (i + 1) * size]),
                        size,
                        event.lora_name,
                        event.cache_salt,
                    )
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if blocks.pop(block_hash, None) is None:
                        self.inconsistencies += 1
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def ordered(self) -> list[tuple[int, CachedBlock]]:
        """Blocks with every cached parent before its children (what a consumer needs)."""
        blocks = self.blocks
        emitted: set[int] = set()
        out: list[tuple[int, CachedBlock]] = []
        for start in blocks:
            chain: list[int] = []
            cursor: int | None = start
            while cursor is not None and cursor in blocks and cursor not in emitted:
                chain.append(cursor)
                emitted.add(cursor)
                cursor = blocks[cursor].parent_hash
            for block_hash in reversed(chain):
                out.append((block_hash, blocks[block_hash]))
        return out


def encode_event(event: object) -> pb.KvEvent:
    if isinstance(event, BlockStored):
        stored = pb.BlockStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_name=event.lora_name,
            cache_salt=event.cache_salt,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return pb.KvEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes))
    if isinstance(event, AllBlocksCleared):
        return pb.KvEvent(cleared=pb.AllBlocksCleared())
    raise TypeError(f"not a KV event: {event!r}")


@dataclass(frozen=True)
class SnapshotSlice:
    """One message's worth of a rank's blocks; ``first``: the rank's first part."""

    rank: int
    blocks: list[tuple[int, CachedBlock]]
    first: bool


def _cut(slices: list[SnapshotSlice], chunk: int) -> list[SnapshotSlice]:
    """Each rank's blocks in parts of at most ``chunk`` (at least one part per rank)."""
    parts: list[SnapshotSlice] = []
    for whole in slices:
        blocks = whole.blocks
        for start in range(0, max(1, len(blocks)), chunk):
            parts.append(SnapshotSlice(whole.rank, blocks[start : start + chunk], start == 0))
    return parts


def _packed(batches: list[pb.KvEventBatch]) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(batches=batches)


class KvEventHub:
    def __init__(
        self,
        instance_id: str,
        replay_batches: int,
        snapshot_chunk_blocks: int,
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        if replay_batches < 1:
            raise ValueError("kv_replay_batches must be at least 1")
        # Packed messages stay well under the message size limit.
        self._pack_bytes = max_message_bytes // 2
        self.instance_id = instance_id
        # One mirror per data-parallel rank: ranks cache independently.
        self.mirrors: dict[int, BlockMirror] = {0: BlockMirror()}
        self.last_seq = 0
        self._capacity = replay_batches
        self._ring: list[pb.SubscribeKvEventsResponse | None] = [None] * replay_batches
        self._chunk = snapshot_chunk_blocks
        self._new_data = asyncio.Event()
        self._closed = False
        self.subscribers = 0
        # The blocks in order as of a sequence number, shared by the snapshots
        # taken there.
        self._ordered: tuple[int, list[SnapshotSlice]] | None = None
        # Its messages, encoded on first use: (part, packed) -> message.
        self._encoded: dict[tuple[int, bool], pb.SubscribeKvEventsResponse] = {}
        # In-process consumers of every numbered batch (the one-process bench).
        self.listeners: list[Callable[[pb.KvEventBatch], object]] = []

    @property
    def oldest_seq(self) -> int:
        """The oldest sequence number still in the replay buffer (last_seq + 1 when empty)."""
        return max(1, self.last_seq - self._capacity + 1)

    def publish(self, batch: KvEventBatch) -> None:
        """Number, mirror and buffer one engine batch; wake the subscribers."""
        if self._closed:
            return
        mirror = self.mirrors.get(batch.data_parallel_rank)
        if mirror is None:
            mirror = self.mirrors[batch.data_parallel_rank] = BlockMirror()
        mirror.apply(batch.events)
        self.last_seq += 1
        metrics.KV_BATCHES.inc()
        metrics.KV_EVENTS.inc(len(batch.events))
        if self.last_seq > self._capacity:  # this batch takes the place of the oldest
            metrics.KV_EVICTIONS.inc()
        message = pb.SubscribeKvEventsResponse(
            batch=pb.KvEventBatch(
                instance_id=self.instance_id,
                sequence_number=self.last_seq,
                events=[encode_event(e) for e in batch.events],
                timestamp_unix_nanos=batch.timestamp_unix_nanos,
                data_parallel_rank=batch.data_parallel_rank,
            )
        )
        self._ring[self.last_seq % self._capacity] = message
        for listener in self.listeners:
            listener(message.batch)
        self._wake()

    def close(self) -> None:
        """End every subscription (server shutdown)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        event, self._new_data = self._new_data, asyncio.Event()
        event.set()

    def set_ranks(self, ranks: int) -> None:
        """The engine's data-parallel ranks: each gets its part of every snapshot
        (its AllBlocksCleared at least), also before it caches anything."""
        for rank in range(ranks):
            self.mirrors.setdefault(rank, BlockMirror())

    def _snapshot_blocks(self) -> tuple[int, list[SnapshotSlice]]:
        """The blocks in order as of last_seq, per rank, shared by every snapshot
        taken there.

        Taken without awaiting, so it is consistent with ``last_seq``; the
        blocks are immutable, so the lists stay right whatever comes next.
        """
        if self._ordered is None or self._ordered[0] != self.last_seq:
            slices = [
                SnapshotSlice(rank, mirror.ordered(), True)
                for rank, mirror in sorted(self.mirrors.items())
            ]
            self._ordered = (self.last_seq, _cut(slices, self._chunk))
            self._encoded = {}
        return self._ordered

    def _snapshot_message(
        self, seq: int, parts: list[SnapshotSlice], index: int, packed: bool
    ) -> pb.SubscribeKvEventsResponse:
        """Part ``index`` of the snapshot at ``seq``, encoded once and shared by every
        subscriber that takes the same snapshot (many at once cost one copy).
        Each rank's parts come in turn, its first one starting with AllBlocksCleared."""
        ordered = self._ordered
        shared = ordered is not None and ordered[0] == seq and ordered[1] is parts
        key = (index, packed)
        if shared and key in self._encoded:
            return self._encoded[key]
        part = parts[index]
        message = pb.SubscribeKvEventsResponse()
        batch = message.batches.add() if packed else message.batch
        batch.instance_id = self.instance_id
        batch.sequence_number = seq
        batch.data_parallel_rank = part.rank
        batch.snapshot.index = index
        batch.snapshot.last = index == len(parts) - 1
        events = batch.events
        if part.first:
            events.add().cleared.SetInParent()
        for block_hash, block in part.blocks:
            stored = events.add().stored  # built in place: no per-event copies
            stored.block_hashes.append(block_hash)
            stored.token_ids.extend(block.token_ids)
            stored.block_size = block.block_size
            if block.lora_name:
                stored.lora_name = block.lora_name
            if block.cache_salt:
                stored.cache_salt = block.cache_salt
            if block.parent_hash is not None:
                stored.parent_block_hash = block.parent_hash
        if shared:
            self._encoded[key] = message
        return message

    def _pack(self, cursor: int, most: int) -> tuple[pb.SubscribeKvEventsResponse, int]:
        """Up to ``most`` waiting batches from ``cursor`` in one message, within the
        size budget (one batch always goes, whatever its size)."""
        batches: list[pb.KvEventBatch] = []
        size = 0
        while cursor <= self.last_seq and len(batches) < most:
            message = self._ring[cursor % self._capacity]
            assert message is not None
            batch = message.batch
            size += batch.ByteSize()
            if batches and size > self._pack_bytes:
                break
            batches.append(batch)
            cursor += 1
        return _packed(batches), cursor

    def _start_cursor(self, request: pb.SubscribeKvEventsRequest) -> int | None:
        """Where a subscription starts; None means "with a snapshot"."""
        if request.include_snapshot:
            return None
        if not request.HasField("start_sequence_number"):
            return self.last_seq + 1
        start = request.start_sequence_number
        other_instance = (
            request.expected_instance_id and request.expected_instance_id != self.instance_id
        )
        if other_instance:
            problem = (
                f"expected_instance_id {clip(request.expected_instance_id)} is not this "
                f"server's instance {self.instance_id!r} (the engine restarted)"
            )
        elif start < self.oldest_seq:
            problem = (
                f"start_sequence_number {start} is no longer buffered (oldest is {self.oldest_seq})"
            )
        elif start > self.last_seq + 1:
            problem = (
                f"start_sequence_number {start} is in the future (next is {self.last_seq + 1})"
            )
        else:
            return start
        if request.snapshot_if_unavailable:
            return None
        raise KvPositionUnavailable(f"{problem}; subscribe with snapshot_if_unavailable")

    def subscribe(self, request: pb.SubscribeKvEventsRequest) -> Subscription:
        """Batches from the requested position, then live, until the hub closes.

        The position is fixed by this call, before the first batch is read: a
        live subscription misses nothing emitted after it (the servicer sends
        the call's headers only then). Raises KvPositionUnavailable at once.
        Counted in ``subscribers`` until ``aclose()``.
        """
        return Subscription(self, self._stream(request, self._start_cursor(request)))

    async def _stream(
        self, request: pb.SubscribeKvEventsRequest, cursor: int | None
    ) -> AsyncGenerator[pb.SubscribeKvEventsResponse, None]:
        most = min(request.max_batches_per_message, MAX_BATCHES_PER_MESSAGE)
        delay = min(request.max_delay_ms, MAX_DELAY_MS) / 1000 if most > 1 else 0.0
        held = False
        per_message = metrics.KV_BATCHES_PER_MESSAGE
        while not self._closed:
            if cursor is None:
                metrics.KV_SNAPSHOTS.inc()
                seq, parts = self._snapshot_blocks()
                cursor = seq + 1
                for index in range(len(parts)):
                    if index:
                        await asyncio.sleep(0)  # a large snapshot does not hold the loop
                    yield self._snapshot_message(seq, parts, index, most > 1)
                continue
            if cursor > self.last_seq:
                await self._new_data.wait()
                continue
            if cursor < self.oldest_seq:
                if not request.snapshot_if_unavailable and not request.include_snapshot:
                    raise KvPositionUnavailable(
                        f"subscriber fell behind: batch {cursor} left the replay buffer "
                        f"(oldest is {self.oldest_seq}); resubscribe with a snapshot"
                    )
                log.warning("KV subscriber fell behind at %d; sending a snapshot", cursor)
                cursor = None
                continue
            if most <= 1:
                buffered = self._ring[cursor % self._capacity]
                assert buffered is not None  # cursor is within [oldest_seq, last_seq]
                cursor += 1
                per_message.observe(1)
                yield buffered
                continue
            if delay and not held and self.last_seq - cursor + 1 < most:
                # Hold the first waiting batch back so that those the engine
                # emits meanwhile share its message.
                held = True
                await asyncio.sleep(delay)
                continue
            held = False
            message, cursor = self._pack(cursor, most)
            per_message.observe(len(message.batches))
            yield message


class Subscription:
    """One subscriber's stream of messages; counted by its hub until closed."""

    def __init__(self, hub: KvEventHub, stream: AsyncGenerator[pb.SubscribeKvEventsResponse, None]):
        self._hub = hub
        self._stream = stream
        self._open = True
        hub.subscribers += 1

    def __aiter__(self) -> Subscription:
        return self

    def __anext__(self) -> Awaitable[pb.SubscribeKvEventsResponse]:
        return self._stream.__anext__()

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._hub.subscribers -= 1
            await self._stream.aclose()
