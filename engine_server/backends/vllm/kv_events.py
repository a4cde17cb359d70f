"""Relay of vLLM's ZMQ KV-event publisher into the server's KvEventSink.

Wire (vllm.distributed.kv_events.ZmqEventPublisher): multipart
``[topic, seq (8-byte big-endian, from 0 per publisher), msgpack KVEventBatch]``,
one publisher per data-parallel rank, each with its own seq.

Endpoints. vLLM's publisher binds when its endpoint has ``*`` or ``::`` or is
ipc/inproc, and connects otherwise; the subscriber does the opposite. When the
user configured nothing, the backend binds this subscriber on
``tcp://127.0.0.1:<OS-chosen port>`` (one port per DP rank, consecutive, as
vLLM offsets rank r to port+r) and tells the engine to connect there: the
events never leave the host, and no port is guessed and raced for.

Delivery. A thread polls the socket and only then receives (NOBLOCK), so a
stop request never abandons a message it has already taken off the socket;
each decoded batch goes to the sink with ``loop.call_soon_threadsafe``, which
keeps engine order. The SUB socket's receive high-water mark is unlimited, so
ZMQ drops nothing on this side. A seq gap (lost batches on the publisher's
side) cannot be repaired here: it is logged as an error and counted in
``lost_batches``; the first batch seen may start above 0 when attaching to an
engine that already ran (library form), which is logged, not counted.

Only device-tier events (``medium`` None or "GPU") are relayed: offloading
tiers publish their own stores and removals, which a router's view of the
device cache must not see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq
from vllm.distributed import kv_events as vkv

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventSink,
)

log = logging.getLogger(__name__)

U64 = (1 << 64) - 1
DEVICE_MEDIA = (None, "GPU")


def block_hash_u64(h: int | bytes) -> int:
    """vLLM's hash as an unsigned 64-bit int (as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & U64
    return h & U64


class SaltChains:
    """Which cache salt each salted block's chain was started under (contract
    revision 11's BlockStored.cache_salt).

    vLLM mixes a request's cache_salt into its first block's hash only, and
    publishes it in that block's ``extra_keys`` (untagged, after the LoRA name);
    a later event extending the chain names only its parent. So the salt is read
    where the chain starts and carried to every block below it; the map holds
    salted blocks only, and forgets them as the engine does.
    """

    def __init__(self) -> None:
        self._salt: dict[tuple[int, int], str] = {}  # (rank, block hash) -> salt

    def stored(self, rank: int, ev: vkv.BlockStored, hashes: Sequence[int]) -> str:
        """The salt of the chain ``ev`` extends ("" none), remembered for its blocks."""
        if ev.parent_block_hash is None:
            salt = _first_block_salt(ev)
        else:
            salt = self._salt.get((rank, block_hash_u64(ev.parent_block_hash)), "")
        if salt:
            self._salt.update(((rank, h), salt) for h in hashes)
        return salt

    def removed(self, rank: int, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._salt.pop((rank, h), None)

    def cleared(self, rank: int) -> None:
        self._salt = {key: salt for key, salt in self._salt.items() if key[0] != rank}


def _first_block_salt(ev: vkv.BlockStored) -> str:
    """The cache salt in a chain's first block's extra keys: its first string that
    is not the LoRA name (the (identifier, offset) pairs of media are tuples)."""
    keys = ev.extra_keys[0] if ev.extra_keys else None
    lora = ev.lora_name
    for key in keys or ():
        if isinstance(key, str):
            if lora is not None and key == lora:
                lora = None  # the LoRA name comes first, once
                continue
            return key
    return ""


def convert_batch(batch: vkv.KVEventBatch, chains: SaltChains | None = None) -> KvEventBatch:
    """Our events from vLLM's; ``chains``: the relay's salt map across batches
    (None: a chain's salt is read only where the chain starts)."""
    chains = chains if chains is not None else SaltChains()
    rank = batch.data_parallel_rank or 0
    events: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, vkv.BlockStored):
            if ev.medium not in DEVICE_MEDIA:
                continue
            hashes = tuple(block_hash_u64(h) for h in ev.block_hashes)
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None
                    if ev.parent_block_hash is None
                    else block_hash_u64(ev.parent_block_hash),
                    token_ids=tuple(ev.token_ids),
                    block_size=ev.block_size,
                    lora_name=ev.lora_name or "",
                    cache_salt=chains.stored(rank, ev, hashes),
                )
            )
        elif isinstance(ev, vkv.BlockRemoved):
            if ev.medium not in DEVICE_MEDIA:
                continue
            hashes = tuple(block_hash_u64(h) for h in ev.block_hashes)
            chains.removed(rank, hashes)
            events.append(BlockRemoved(block_hashes=hashes))
        elif isinstance(ev, vkv.AllBlocksCleared):
            chains.cleared(rank)
            events.append(AllBlocksCleared())
        else:  # a newer vLLM's event type: say so once per type rather than guess
            log.warning("ignoring unknown KV event type %s", type(ev).__name__)
    return KvEventBatch(
        events=tuple(events),
        timestamp_unix_nanos=int(batch.ts * 1e9),
        data_parallel_rank=rank,
    )


def subscriber_side(publisher_endpoint: str) -> tuple[str, str]:
    """("connect"|"bind", endpoint) for a subscriber of this publisher endpoint."""
    ep = publisher_endpoint
    if ep.startswith("inproc://"):
        raise ValueError(f"cannot subscribe to an in-process publisher ({ep}) from another process")
    if ep.startswith("ipc://"):
        return "connect", ep
    if "*" in ep:
        return "connect", ep.replace("*", "127.0.0.1")
    if "::" in ep:  # tcp://[::]:P binds every IPv6 address
        return "connect", ep.replace("[::]", "[::1]")
    return "bind", ep


class KvEventSubscriber:
    """Reads one or more vLLM KV-event publishers and feeds the sink in order."""

    POLL_MS = 50

    def __init__(
        self,
        sink: KvEventSink,
        loop: asyncio.AbstractEventLoop,
        topic: str = "",
        expect_from_zero: bool = True,
    ) -> None:
        # expect_from_zero: subscribed before the engine started, so its first
        # batch must be seq 0 and a later first seq means batches were lost.
        self._expect_from_zero = expect_from_zero
        self._sink = sink
        self._loop = loop
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # unlimited: never drop on our side
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
        self._chains = SaltChains()
        self._next_seq: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drain_s = 0.5
        self._closed = False
        self.lost_batches = 0
        self.batches = 0
        self.endpoints: list[str] = []

    # -- set-up ------------------------------------------------------------
    def bind_loopback_ports(self, count: int) -> int:
        """Bind ``count`` consecutive loopback ports (DP ranks); return the first."""
        for _ in range(50):
            first = self._bind(f"tcp://127.0.0.1:{0}")
            port = int(first.rsplit(":", 1)[1])
            bound = [first]
            try:
                for r in range(1, count):
                    bound.append(self._bind(f"tcp://127.0.0.1:{port + r}"))
            except zmq.ZMQError:
                for ep in bound:
                    self._sock.unbind(ep)
                    self.endpoints.remove(ep)
                continue
            return port
        raise RuntimeError(f"no {count} consecutive free loopback ports for KV events")

    def attach(self, publisher_endpoints: Sequence[str]) -> None:
        """Subscribe to publishers configured elsewhere (bind or connect as needed)."""
        for ep in publisher_endpoints:
            mode, sub_ep = subscriber_side(ep)
            if sub_ep.startswith("tcp://[") or "::" in sub_ep:
                self._sock.setsockopt(zmq.IPV6, 1)
            if mode == "bind":
                self._bind(sub_ep)
            else:
                self._sock.connect(sub_ep)
                self.endpoints.append(sub_ep)

    def _bind(self, ep: str) -> str:
        self._sock.bind(ep)
        actual = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(actual)
        return actual

    # -- running -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    async def stop(self, drain_s: float = 0.5) -> None:
        """Deliver what still arrives until ``drain_s`` of quiet, then close. Idempotent."""
        if self._closed:
            return
        self._drain_s = drain_s
        self._stop.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 5 * drain_s + 2.0)
            if thread.is_alive():  # never close a socket another thread still uses
                log.error("KV-event relay thread did not stop; leaving its socket open")
                return
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        quiet_since: float | None = None  # set once stopping: start of the current quiet
        hard_deadline = float("inf")  # stop even if the publisher never goes quiet
        try:
            while True:
                if self._stop.is_set():
                    now = time.monotonic()
                    if quiet_since is None:
                        quiet_since = now
                        hard_deadline = now + 4 * self._drain_s
                    if now - quiet_since >= self._drain_s or now >= hard_deadline:
                        return
                if not self._sock.poll(self.POLL_MS, zmq.POLLIN):
                    continue
                quiet_since = None if not self._stop.is_set() else time.monotonic()
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                self._handle(frames)
        except Exception:  # the relay must not die silently
            log.exception("KV-event relay stopped by an error")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.error("malformed KV-event message with %d frames; ignored", len(frames))
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        try:
            batch = convert_batch(self._decoder.decode(payload), self._chains)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Counted as lost by the gap check when the rank's next batch comes.
            log.exception("undecodable KV-event batch seq %d (a newer vLLM?); dropped", seq)
            return
        rank = batch.data_parallel_rank
        expected = self._next_seq.get(rank)
        if expected is None and self._expect_from_zero:
            expected = 0
        if expected is None:
            if seq != 0:
                log.info("KV events of DP rank %d: joined at seq %d", rank, seq)
        elif seq != expected:
            if seq > expected:
                self.lost_batches += seq - expected
                log.error(
                    "KV events LOST: DP rank %d seq %d..%d (%d batches) never arrived; "
                    "the cache view built from these events is now wrong",
                    rank,
                    expected,
                    seq - 1,
                    seq - expected,
                )
            else:
                log.error(
                    "KV events of DP rank %d went back from seq %d to %d (publisher restarted?)",
                    rank,
                    expected - 1,
                    seq,
                )
        self._next_seq[rank] = seq + 1
        self.batches += 1
        with contextlib.suppress(RuntimeError):  # loop closed: nobody left to tell
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: KvEventBatch) -> None:
        try:
            self._sink(batch)
        except Exception:
            log.exception("KV-event sink raised; batch dropped by the sink")
