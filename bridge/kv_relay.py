"""KvRelay: the engine server's KV-event stream -> Dynamo's KvEventPublisher.

No Dynamo import: the publisher arrives as an object through
``PushSource(on_ready=relay.on_ready)``. Until it does, what the stream brings
is buffered (bounded; on overflow the buffer is dropped and a fresh snapshot
is asked for once the publisher is there).

Position: the first subscription asks for a snapshot; after a broken stream
the relay resumes at ``last sequence + 1`` on the same instance, accepting a
snapshot if the server cannot replay from there. Dynamo 1.6.1's publisher has
no clear-all call, so "clear this worker" (AllBlocksCleared, or a new engine
instance id) is ``publish_removed`` of every hash published and not removed.
Engine hashes are unsigned 64-bit; Dynamo wants signed int64.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def to_signed(block_hash: int) -> int:
    """The engine's unsigned 64-bit hash as the signed int64 Dynamo expects."""
    return block_hash - _U64 if block_hash > _I64_MAX else block_hash


class Verdict(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # already seen (a replay overlapping what we had)
    RESYNC = "resync"  # a gap or a stray batch: subscribe again from our position


class KvRelay:
    """Consumes SubscribeKvEvents and publishes into Dynamo, keeping the router's
    view of this worker equal to the engine's cache."""

    def __init__(
        self,
        client: EngineClient | None,
        block_size: int,
        *,
        on_instance_change: Callable[[str], None] | None = None,
        max_buffered: int = 100_000,
        backoff_s: tuple[float, float] = (0.1, 5.0),
        max_batches_per_message: int = 256,
        max_delay_ms: int = 0,
    ) -> None:
        self._client = client
        self.block_size = block_size
        self._on_instance_change = on_instance_change
        self._max_buffered = max_buffered
        self._backoff_s = backoff_s
        # Several engine batches per stream message (servers of contract
        # revision 2; older ones send one each): fewer messages to pay for.
        self._max_batches_per_message = max_batches_per_message
        self._max_delay_ms = max_delay_ms
        self.instance_id: str | None = None
        self.last_seq: int | None = None
        # Signed hashes published (or buffered) and not removed since.
        self.known: set[int] = set()
        self._publisher: Any | None = None
        self._pending: list[tuple[str, dict[str, Any]]] = []
        # While a batch is applied, its events collect here and go to Dynamo in
        # one publish_batch call (one crossing into Dynamo's runtime per batch).
        self._outbox: list[tuple[str, dict[str, Any]]] | None = None
        self._overflowed = False
        self._snapshot_next: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._resync = False
        self.batches_applied = 0

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Start streaming on the running loop (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._run(), name="kv-relay")

    def on_ready(self, publisher: Any) -> None:
        """PushSource callback; may come from a runtime thread, so hop onto our loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.set_publisher, publisher)
        else:
            self.set_publisher(publisher)

    async def stop(self) -> None:
        """Stop the stream; safe to call twice or without start()."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._publisher = None

    # -- publisher ---------------------------------------------------------

    def set_publisher(self, publisher: Any) -> None:
        self._publisher = publisher
        pending, self._pending = self._pending, []
        self._publish_all(pending)
        log.info("kv relay: publisher ready, %d buffered events sent", len(pending))
        if self._overflowed:
            # What overflowed is lost: start over from a snapshot.
            self._overflowed = False
            self._reset_position()
            self._request_resync()

    def _emit(self, kind: str, kwargs: dict[str, Any]) -> None:
        if self._publisher is not None:
            if self._outbox is not None:
                self._outbox.append((kind, kwargs))
            else:
                self._publish(kind, kwargs)
            return
        if self._overflowed:
            return
        self._pending.append((kind, kwargs))
        if len(self._pending) > self._max_buffered:
            log.warning(
                "kv relay: over %d events before the publisher came; dropping them",
                self._max_buffered,
            )
            self._pending.clear()
            self.known.clear()
            self._overflowed = True

    def _publish_all(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """In order; one ``publish_batch`` call when the publisher has it (Dynamo 1.6.1
        does), else (or if the batch is refused) one call per event."""
        publish_batch = getattr(self._publisher, "publish_batch", None)
        if publish_batch is not None and len(events) > 1:
            try:
                # The publisher validates the whole list before it enqueues any of it.
                publish_batch([{"type": kind, **kwargs} for kind, kwargs in events])
                return
            except Exception:
                log.warning("kv relay: publish_batch failed; publishing one by one", exc_info=True)
        for kind, kwargs in events:
            self._publish(kind, kwargs)

    def _publish(self, kind: str, kwargs: dict[str, Any]) -> None:
        try:
            if kind == "stored":
                self._publisher.publish_stored(**kwargs)
            else:
                self._publisher.publish_removed(**kwargs)
        except Exception:  # one bad event must not end the relay
            log.exception("kv relay: publishing a %s event failed", kind)

    # -- events ------------------------------------------------------------

    def subscription_request(self) -> pb.SubscribeKvEventsRequest:
        """Where to (re)start: a snapshot first, then resume after the last batch."""
        packing = {
            "max_batches_per_message": self._max_batches_per_message,
            "max_delay_ms": self._max_delay_ms,
        }
        if self.instance_id is None or self.last_seq is None:
            return pb.SubscribeKvEventsRequest(include_snapshot=True, **packing)
        return pb.SubscribeKvEventsRequest(
            start_sequence_number=self.last_seq + 1,
            snapshot_if_unavailable=True,
            expected_instance_id=self.instance_id,
            **packing,
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
            if outbox and self._publisher is not None:
                self._publish_all(outbox)

    def _apply_batch(self, batch: pb.KvEventBatch) -> Verdict:
        if self._overflowed and self._publisher is None:
            return Verdict.STALE
        if batch.instance_id != self.instance_id:
            self._new_instance(batch.instance_id)
        seq = batch.sequence_number
        if batch.HasField("snapshot"):
            part = batch.snapshot
            if part.index != (0 if self._snapshot_next is None else self._snapshot_next):
                self._reset_position()
                return Verdict.RESYNC
            self._snapshot_next = None if part.last else part.index + 1
        else:
            if self._snapshot_next is not None:
                # A live batch in the middle of a snapshot: start over.
                self._reset_position()
                return Verdict.RESYNC
            if self.last_seq is None:
                if seq != 1:  # history we never saw: take a snapshot instead
                    return Verdict.RESYNC
            elif seq <= self.last_seq:
                return Verdict.STALE
            elif seq != self.last_seq + 1:
                log.warning("kv relay: gap after batch %d (got %d); resuming", self.last_seq, seq)
                return Verdict.RESYNC
        for event in batch.events:
            self._apply_event(event)
        self.last_seq = seq
        self.batches_applied += 1
        return Verdict.APPLIED

    def _apply_event(self, event: pb.KvEvent) -> None:
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
            self.known.update(hashes)
            self._emit(
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
                },
            )
        elif which == "removed":
            hashes = [to_signed(h) for h in event.removed.block_hashes]
            if hashes:
                self.known.difference_update(hashes)
                self._emit("removed", {"block_hashes": hashes})
        elif which == "cleared":
            self.clear()

    def clear(self) -> None:
        """Drop this worker's blocks from the router's view (no clear-all in Dynamo 1.6.1)."""
        if self._publisher is None:
            # Nothing reached Dynamo yet: forgetting the buffer is the same thing.
            self._pending.clear()
        elif self.known:
            self._emit("removed", {"block_hashes": sorted(self.known)})
        self.known.clear()

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

    def _reset_position(self) -> None:
        self.last_seq = None
        self._snapshot_next = None

    # -- stream ------------------------------------------------------------

    def _request_resync(self) -> None:
        self._resync = True
        if self._call is not None:
            self._call.cancel()

    async def _run(self) -> None:
        assert self._client is not None
        low, high = self._backoff_s
        delay = low
        while True:
            request = self.subscription_request()
            call = self._client.subscribe_kv_events(request)
            self._call, self._resync = call, False
            try:
                async for response in call:
                    verdict = self.apply_message(response)
                    if verdict is Verdict.APPLIED:
                        delay = low
                    elif verdict is Verdict.RESYNC:
                        break
                else:
                    log.info("kv relay: the engine server ended the stream; resubscribing")
                # Resubscribe after a pause that grows while nothing applies.
                call.cancel()
                await asyncio.sleep(delay)
                delay = min(delay * 2, high)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._resync or (task is not None and task.cancelling()):
                    raise
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning(
                        "kv relay: engine server has no KV events (%s); relay off", e.details()
                    )
                    return
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    self._reset_position()
                elif not (code == grpc.StatusCode.CANCELLED and self._resync):
                    log.warning(
                        "kv relay: stream failed (%s: %s); retrying in %.1fs",
                        code.name,
                        e.details(),
                        delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, high)
            finally:
                call.cancel()
                self._call = None
