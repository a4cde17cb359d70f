"""RouterView and KvRelay: batches -> publisher calls, clearing, instance changes, resuming."""

from __future__ import annotations

import inspect

from dynamo._core import KvEventPublisher

from bridge.client import EngineClient
from bridge.dynamo_compat import publishes_cache_salt
from bridge.kv_relay import KvRelay
from bridge.kv_view import RouterView, Verdict, to_signed
from engine_contract.v1 import engine_pb2 as pb
from harness.waits import wait_until_async
from tests.bridge.bridge_fakes import FakeServer, RecordingPublisher

BS = 2
BIG = 2**64 - 5  # an engine hash above 2^63


def stored(*hashes: int, parent: int | None = None) -> pb.KvEvent:
    tokens = [h % 100 for h in hashes for _ in range(BS)]
    ev = pb.BlockStored(block_hashes=list(hashes), token_ids=tokens, block_size=BS)
    if parent is not None:
        ev.parent_block_hash = parent
    return pb.KvEvent(stored=ev)


def removed(*hashes: int) -> pb.KvEvent:
    return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=list(hashes)))


def cleared() -> pb.KvEvent:
    return pb.KvEvent(cleared=pb.AllBlocksCleared())


def batch(
    seq: int, *events: pb.KvEvent, instance: str = "A", snapshot: tuple[int, bool] | None = None
) -> pb.KvEventBatch:
    b = pb.KvEventBatch(instance_id=instance, sequence_number=seq, events=list(events))
    if snapshot is not None:
        b.snapshot.CopyFrom(pb.SnapshotPart(index=snapshot[0], last=snapshot[1]))
    return b


def subscription(**fields: object) -> pb.SubscribeKvEventsRequest:
    """What the relay asks for: a position, and its batch packing."""
    return pb.SubscribeKvEventsRequest(max_batches_per_message=256, **fields)  # type: ignore[arg-type]


def relay_with_publisher() -> tuple[RouterView, RecordingPublisher]:
    relay = RouterView(BS)
    publisher = RecordingPublisher()
    relay.set_publisher(publisher)
    return relay, publisher


def test_unsigned_hashes_convert_to_signed_64_bit() -> None:
    assert to_signed(0) == 0
    assert to_signed(2**63 - 1) == 2**63 - 1
    assert to_signed(2**63) == -(2**63)
    assert to_signed(2**64 - 1) == -1


def test_snapshot_then_live_batches_are_published() -> None:
    relay, pub = relay_with_publisher()
    assert relay.subscription_request() == subscription(include_snapshot=True)
    assert (
        relay.apply_batch(batch(3, cleared(), stored(10, 11), snapshot=(0, False)))
        is Verdict.APPLIED
    )
    assert relay.apply_batch(batch(3, stored(12, parent=11), snapshot=(1, True))) is Verdict.APPLIED
    assert relay.apply_batch(batch(4, stored(BIG, parent=12), removed(10))) is Verdict.APPLIED
    assert pub.calls[0] == (
        "stored",
        {
            "token_ids": [10, 10, 11, 11],
            "num_block_tokens": [BS, BS],
            "block_hashes": [10, 11],
            "parent_hash": None,
            "lora_name": None,
        },
    )
    assert pub.calls[1][1]["parent_hash"] == 11
    assert pub.calls[2][1]["block_hashes"] == [to_signed(BIG)] and to_signed(BIG) < 0
    assert pub.calls[3] == ("removed", {"block_hashes": [10]})
    assert pub.live_hashes() == relay.known == {11, 12, to_signed(BIG)}
    assert relay.subscription_request() == subscription(
        start_sequence_number=5, snapshot_if_unavailable=True, expected_instance_id="A"
    )


def test_a_salted_chain_reaches_the_router_with_its_salt_where_dynamo_takes_one() -> None:
    """The publisher's ``cache_salt`` (Dynamo 1.6.1; 1.3.0.post1's takes none, and the
    call must not fail there), on every event of the salted chain only."""
    relay, pub = relay_with_publisher()
    salted = stored(1, 2)
    salted.stored.cache_salt = "tenant-a"
    relay.apply_batch(batch(1, salted, stored(3)))
    want = {"cache_salt": "tenant-a"} if publishes_cache_salt() else {}
    assert {k: v for k, v in pub.calls[0][1].items() if k == "cache_salt"} == want
    assert "cache_salt" not in pub.calls[1][1]
    real = inspect.signature(KvEventPublisher.publish_stored).parameters
    assert set(pub.calls[0][1]) <= set(real)


def test_all_cleared_removes_every_known_hash() -> None:
    relay, pub = relay_with_publisher()
    relay.apply_batch(batch(1, stored(1, 2), stored(BIG, parent=2)))
    relay.apply_batch(batch(2, removed(1)))
    relay.apply_batch(batch(3, cleared()))
    assert pub.calls[-1] == ("removed", {"block_hashes": sorted([2, to_signed(BIG)])})
    assert pub.live_hashes() == set() and relay.known == set()


def test_instance_change_clears_and_rebuilds_from_the_snapshot() -> None:
    changes: list[str] = []
    relay = RouterView(BS, on_instance_change=changes.append)
    pub = RecordingPublisher()
    relay.set_publisher(pub)
    relay.apply_batch(batch(1, stored(1, 2)))
    relay.apply_batch(batch(2, stored(3, parent=2)))
    # The server restarted; our resume request got a snapshot of the new instance.
    assert (
        relay.apply_batch(batch(0, cleared(), stored(7), instance="B", snapshot=(0, True)))
        is Verdict.APPLIED
    )
    assert ("removed", {"block_hashes": [1, 2, 3]}) in pub.calls
    assert pub.live_hashes() == {7}
    assert changes == ["A", "B"]
    assert relay.subscription_request().expected_instance_id == "B"
    assert relay.subscription_request().start_sequence_number == 1


def test_new_instance_without_snapshot_needs_one_unless_from_the_start() -> None:
    relay, pub = relay_with_publisher()
    relay.apply_batch(batch(1, stored(1)))
    assert relay.apply_batch(batch(9, stored(5), instance="B")) is Verdict.RESYNC
    assert pub.live_hashes() == set()  # the old instance's blocks are gone
    assert relay.subscription_request() == subscription(include_snapshot=True)
    # A new instance's very first batch is its whole history.
    relay2, pub2 = relay_with_publisher()
    assert relay2.apply_batch(batch(1, stored(4), instance="C")) is Verdict.APPLIED
    assert pub2.live_hashes() == {4}


def test_replayed_batches_skipped_and_gaps_resync() -> None:
    relay, pub = relay_with_publisher()
    relay.apply_batch(batch(1, stored(1)))
    relay.apply_batch(batch(2, stored(2)))
    assert relay.apply_batch(batch(2, stored(2))) is Verdict.STALE
    assert relay.apply_batch(batch(1, stored(1))) is Verdict.STALE
    assert relay.apply_batch(batch(4, stored(4))) is Verdict.RESYNC
    assert pub.live_hashes() == {1, 2}
    # Resume right after the last batch applied.
    assert relay.subscription_request().start_sequence_number == 3


def test_snapshot_out_of_order_resyncs() -> None:
    relay, _ = relay_with_publisher()
    assert relay.apply_batch(batch(5, stored(1), snapshot=(1, True))) is Verdict.RESYNC
    relay.apply_batch(batch(5, cleared(), snapshot=(0, False)))
    assert relay.apply_batch(batch(6, stored(1))) is Verdict.RESYNC


def test_buffered_until_the_publisher_arrives() -> None:
    relay = RouterView(BS)
    relay.apply_batch(batch(1, stored(1, 2)))
    relay.apply_batch(batch(2, removed(1)))
    pub = RecordingPublisher()
    relay.set_publisher(pub)
    assert [kind for kind, _ in pub.calls] == ["stored", "removed"]
    assert pub.live_hashes() == {2}


def test_clear_before_the_publisher_drops_the_buffer() -> None:
    relay = RouterView(BS)
    relay.apply_batch(batch(1, stored(1, 2)))
    relay.apply_batch(batch(2, cleared(), stored(3)))
    pub = RecordingPublisher()
    relay.set_publisher(pub)
    assert pub.calls == [("stored", pub.calls[0][1])]
    assert pub.live_hashes() == {3}


def test_buffer_overflow_asks_for_a_new_snapshot() -> None:
    relay = RouterView(BS, max_buffered=2)
    for seq in range(1, 5):
        relay.apply_batch(batch(seq, stored(seq)))
    pub = RecordingPublisher()
    relay.set_publisher(pub)
    assert pub.calls == []
    assert relay.subscription_request() == subscription(include_snapshot=True)


def test_malformed_stored_event_skipped() -> None:
    relay, pub = relay_with_publisher()
    bad = pb.KvEvent(stored=pb.BlockStored(block_hashes=[1, 2], token_ids=[1], block_size=BS))
    relay.apply_batch(batch(1, bad, stored(3)))
    assert pub.live_hashes() == {3}


async def test_stream_subscribes_resumes_and_stops() -> None:
    async with FakeServer() as server:
        fake = server.engine
        client = EngineClient(server.address)
        relay = KvRelay(client, RouterView(BS), backoff_s=(0.01, 0.05))
        relay.start()
        relay.on_ready(pub := RecordingPublisher())
        await fake.kv_batches.put(batch(2, cleared(), stored(1), snapshot=(0, True)))
        await fake.kv_batches.put(batch(3, stored(2, parent=1)))
        await fake.kv_batches.put(None)  # the server ends the stream: resume
        await fake.kv_batches.put(batch(4, stored(3, parent=2)))
        await wait_until_async(lambda: pub.live_hashes() == {1, 2, 3}, 5, "blocks 1, 2, 3 live")
        assert fake.kv_requests[0].include_snapshot
        assert fake.kv_requests[1] == subscription(
            start_sequence_number=4, snapshot_if_unavailable=True, expected_instance_id="A"
        )
        await relay.stop()
        await relay.stop()
        await client.close()


async def test_overflow_before_the_publisher_resubscribes_for_a_snapshot() -> None:
    async with FakeServer() as server:
        fake = server.engine
        client = EngineClient(server.address)
        relay = KvRelay(client, RouterView(BS, max_buffered=1), backoff_s=(0.01, 0.05))
        relay.start()
        for seq in (1, 2, 3):
            await fake.kv_batches.put(batch(seq, stored(seq)))
        await wait_until_async(
            lambda: fake.kv_batches.empty() and relay.view._overflowed,
            5,
            "the relay's buffer overflowed",
        )
        pub = RecordingPublisher()
        relay.on_ready(pub)
        await wait_until_async(lambda: len(fake.kv_requests) == 2, 5, "a second subscription")
        assert [r.include_snapshot for r in fake.kv_requests] == [True, True]
        await fake.kv_batches.put(batch(3, cleared(), stored(1, 2, 3), snapshot=(0, True)))
        await wait_until_async(lambda: pub.live_hashes() == {1, 2, 3}, 5, "blocks 1, 2, 3 live")
        await relay.stop()
        await client.close()


class BatchingPublisher(RecordingPublisher):
    """A publisher with Dynamo's publish_batch; optionally refusing every batch."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.batches: list[list[dict[str, object]]] = []
        self.refuse = refuse

    def publish_batch(self, events: list[dict[str, object]]) -> None:
        if self.refuse:
            raise ValueError("invalid batch")
        self.batches.append(events)
        for event in events:
            kwargs = dict(event)
            self.calls.append((str(kwargs.pop("type")), kwargs))


def test_each_batch_goes_to_publish_batch_in_one_call() -> None:
    expected_relay, expected = relay_with_publisher()
    relay = RouterView(BS)
    pub = BatchingPublisher()
    relay.set_publisher(pub)
    batches = [
        batch(1, stored(10, 11), stored(12, parent=11), removed(10)),
        batch(2, stored(13)),
        batch(3, cleared(), stored(14)),
    ]
    for b in batches:
        assert relay.apply_batch(b) is Verdict.APPLIED
        assert expected_relay.apply_batch(b) is Verdict.APPLIED
    # The same events in the same order; several per call, one call per batch
    # (a single event goes through publish_stored).
    assert pub.calls == expected.calls
    assert [len(b) for b in pub.batches] == [3, 2]
    assert pub.batches[0][0]["type"] == "stored" and pub.batches[0][2]["type"] == "removed"


def test_a_refused_batch_is_published_event_by_event() -> None:
    expected_relay, expected = relay_with_publisher()
    relay = RouterView(BS)
    pub = BatchingPublisher(refuse=True)
    relay.set_publisher(pub)
    b = batch(1, stored(10, 11), removed(10))
    assert relay.apply_batch(b) is Verdict.APPLIED
    expected_relay.apply_batch(b)
    assert pub.batches == [] and pub.calls == expected.calls
