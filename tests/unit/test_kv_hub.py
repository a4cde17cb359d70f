"""KvEventHub: numbering, replay, snapshots and the block mirror, without gRPC."""

from __future__ import annotations

import asyncio

import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from engine_server.errors import KvPositionUnavailable
from engine_server.kv_events import BlockMirror, KvEventHub

BS = 4


def stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    tokens = tuple(t for h in hashes for t in [h % 1000] * BS)
    return BlockStored(tuple(hashes), parent, tokens, BS)


def batch(*events: object) -> KvEventBatch:
    return KvEventBatch(tuple(events))  # type: ignore[arg-type]


async def take(agen, n: int) -> list[pb.SubscribeKvEventsResponse]:
    return [await asyncio.wait_for(agen.__anext__(), 1) for _ in range(n)]


def apply_messages(messages: list[pb.SubscribeKvEventsResponse]) -> set[int]:
    blocks: set[int] = set()
    for message in messages:
        for event in message.batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                blocks.update(event.stored.block_hashes)
            elif kind == "removed":
                blocks.difference_update(event.removed.block_hashes)
            else:
                blocks.clear()
    return blocks


def test_mirror_tracks_stored_minus_removed_and_counts_unknown_removals() -> None:
    mirror = BlockMirror()
    mirror.apply([stored([1, 2, 3]), BlockRemoved((2,)), BlockRemoved((99,))])
    assert set(mirror.blocks) == {1, 3}
    assert mirror.blocks[3].parent_hash == 2
    assert mirror.blocks[1].token_ids == (1,) * BS
    assert mirror.inconsistencies == 1
    mirror.apply([AllBlocksCleared()])
    assert mirror.blocks == {}


def test_mirror_orders_parents_before_children_even_when_reinserted() -> None:
    mirror = BlockMirror()
    mirror.apply([stored([1, 2]), stored([3], parent=2), BlockRemoved((1,)), stored([1])])
    order = [h for h, _ in mirror.ordered()]
    assert order.index(2) < order.index(3)
    assert sorted(order) == [1, 2, 3]
    # Remove the middle of a chain and store it again after its child.
    mirror.apply([BlockRemoved((2,)), stored([2], parent=1)])
    order = [h for h, _ in mirror.ordered()]
    assert order.index(1) < order.index(2) < order.index(3)


async def test_live_batches_have_contiguous_sequence_numbers_and_instance() -> None:
    hub = KvEventHub("inst-a", replay_batches=8, snapshot_chunk_blocks=100)
    sub = hub.subscribe(pb.SubscribeKvEventsRequest())
    first = asyncio.ensure_future(sub.__anext__())
    await asyncio.sleep(0)
    hub.publish(batch(stored([1])))
    hub.publish(batch(stored([2], parent=1)))
    got = [await asyncio.wait_for(first, 1), *(await take(sub, 1))]
    assert [m.batch.sequence_number for m in got] == [1, 2]
    assert {m.batch.instance_id for m in got} == {"inst-a"}
    assert got[1].batch.events[0].stored.parent_block_hash == 1
    await sub.aclose()
    assert hub.subscribers == 0


async def test_resume_replays_from_requested_sequence() -> None:
    hub = KvEventHub("i", replay_batches=8, snapshot_chunk_blocks=100)
    for h in range(1, 6):
        hub.publish(batch(stored([h])))
    sub = hub.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=3))
    got = await take(sub, 3)
    assert [m.batch.sequence_number for m in got] == [3, 4, 5]
    await sub.aclose()


async def test_expired_position_is_an_error_or_a_snapshot_never_a_gap() -> None:
    hub = KvEventHub("i", replay_batches=4, snapshot_chunk_blocks=2)
    for h in range(1, 11):
        hub.publish(batch(stored([h])))
    hub.publish(batch(BlockRemoved((1, 2))))
    assert hub.oldest_seq == 8
    with pytest.raises(KvPositionUnavailable, match="no longer buffered"):
        await hub.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=2)).__anext__()
    sub = hub.subscribe(
        pb.SubscribeKvEventsRequest(start_sequence_number=2, snapshot_if_unavailable=True)
    )
    # 8 blocks in chunks of 2: four snapshot messages, all at sequence 11.
    parts = await take(sub, 4)
    assert {m.batch.sequence_number for m in parts} == {11}
    assert [m.batch.snapshot.index for m in parts] == [0, 1, 2, 3]
    assert [m.batch.snapshot.last for m in parts] == [False, False, False, True]
    assert parts[0].batch.events[0].WhichOneof("event") == "cleared"
    assert apply_messages(parts) == set(range(3, 11))
    hub.publish(batch(stored([42])))
    (live,) = await take(sub, 1)
    assert live.batch.sequence_number == 12 and not live.batch.HasField("snapshot")
    await sub.aclose()


async def test_future_position_and_other_instance_are_refused() -> None:
    hub = KvEventHub("mine", replay_batches=4, snapshot_chunk_blocks=2)
    hub.publish(batch(stored([1])))
    with pytest.raises(KvPositionUnavailable, match="in the future"):
        await hub.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=5)).__anext__()
    request = pb.SubscribeKvEventsRequest(start_sequence_number=1, expected_instance_id="old")
    with pytest.raises(KvPositionUnavailable, match="engine restarted"):
        await hub.subscribe(request).__anext__()
    request.snapshot_if_unavailable = True
    (snap,) = await take(hub.subscribe(request), 1)
    assert snap.batch.snapshot.last and apply_messages([snap]) == {1}


async def test_snapshot_of_empty_cache_is_one_clear_at_sequence_zero() -> None:
    hub = KvEventHub("i", replay_batches=4, snapshot_chunk_blocks=2)
    (snap,) = await take(hub.subscribe(pb.SubscribeKvEventsRequest(include_snapshot=True)), 1)
    assert snap.batch.sequence_number == 0
    assert [e.WhichOneof("event") for e in snap.batch.events] == ["cleared"]


async def test_slow_subscriber_that_falls_out_of_the_buffer_gets_snapshot_or_error() -> None:
    hub = KvEventHub("i", replay_batches=3, snapshot_chunk_blocks=100)
    strict = hub.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=1))
    lenient = hub.subscribe(
        pb.SubscribeKvEventsRequest(start_sequence_number=1, snapshot_if_unavailable=True)
    )
    hub.publish(batch(stored([1])))
    assert (await take(strict, 1))[0].batch.sequence_number == 1
    assert (await take(lenient, 1))[0].batch.sequence_number == 1
    for h in range(2, 8):
        hub.publish(batch(stored([h])))
    with pytest.raises(KvPositionUnavailable, match="fell behind"):
        await strict.__anext__()
    (snap,) = await take(lenient, 1)
    assert snap.batch.HasField("snapshot") and snap.batch.sequence_number == 7
    assert apply_messages([snap]) == set(range(1, 8))


async def test_close_ends_subscriptions() -> None:
    hub = KvEventHub("i", replay_batches=3, snapshot_chunk_blocks=100)
    sub = hub.subscribe(pb.SubscribeKvEventsRequest())
    pending = asyncio.ensure_future(sub.__anext__())
    await asyncio.sleep(0)
    hub.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 1)


async def test_waiting_batches_share_a_message_up_to_the_maximum() -> None:
    hub = KvEventHub("i", replay_batches=16, snapshot_chunk_blocks=100)
    sub = hub.subscribe(pb.SubscribeKvEventsRequest(max_batches_per_message=3))
    for h in range(1, 6):
        hub.publish(batch(stored([h])))
    first, second = await take(sub, 2)
    assert not first.HasField("batch") and not second.HasField("batch")
    assert [b.sequence_number for b in first.batches] == [1, 2, 3]
    assert [b.sequence_number for b in second.batches] == [4, 5]
    await sub.aclose()


async def test_a_held_batch_waits_for_those_that_follow_within_the_delay() -> None:
    hub = KvEventHub("i", replay_batches=16, snapshot_chunk_blocks=100)
    sub = hub.subscribe(pb.SubscribeKvEventsRequest(max_batches_per_message=8, max_delay_ms=50))
    pending = asyncio.ensure_future(sub.__anext__())
    await asyncio.sleep(0)
    hub.publish(batch(stored([1])))
    await asyncio.sleep(0.01)
    assert not pending.done()  # held for the ones that follow
    hub.publish(batch(stored([2], parent=1)))
    hub.publish(batch(BlockRemoved((1,))))
    message = await asyncio.wait_for(pending, 1)
    assert [b.sequence_number for b in message.batches] == [1, 2, 3]
    await sub.aclose()


async def test_packed_snapshots_and_the_size_budget() -> None:
    # A 4 KiB limit: packed messages stay under half of it.
    hub = KvEventHub("i", replay_batches=64, snapshot_chunk_blocks=2, max_message_bytes=4096)
    for h in range(1, 4):
        hub.publish(batch(stored([h])))
    sub = hub.subscribe(
        pb.SubscribeKvEventsRequest(include_snapshot=True, max_batches_per_message=100)
    )
    snapshot = await take(sub, 2)  # 3 blocks in chunks of 2: one batch per message
    assert [len(m.batches) for m in snapshot] == [1, 1]
    assert [m.batches[0].snapshot.index for m in snapshot] == [0, 1]
    for h in range(10, 40):
        hub.publish(batch(stored([h * 10**15 + i for i in range(16)])))
    packed = []
    while sum(len(m.batches) for m in packed) < 30:
        (message,) = await take(sub, 1)
        assert len(message.batches) == 1 or message.ByteSize() <= 2048
        packed.append(message)
    assert 1 < len(packed) < 30
    seqs = [b.sequence_number for m in packed for b in m.batches]
    assert seqs == list(range(4, 34))
    await sub.aclose()


async def test_a_snapshot_keeps_data_parallel_ranks_apart() -> None:
    """Each rank's blocks come in its own parts, tagged with its rank, each rank's
    first part clearing that rank; a removal on one rank leaves the other's copy."""
    hub = KvEventHub("inst", replay_batches=16, snapshot_chunk_blocks=1)
    hub.set_ranks(3)  # rank 2 caches nothing: it still gets its clear
    hub.publish(KvEventBatch((stored([1, 2, 3]),), data_parallel_rank=0))
    hub.publish(KvEventBatch((stored([1, 7]),), data_parallel_rank=1))
    hub.publish(KvEventBatch((BlockRemoved((1,)),), data_parallel_rank=0))
    subscription = hub.subscribe(pb.SubscribeKvEventsRequest(include_snapshot=True))
    parts = await take(subscription, 5)  # one block a part: 2 for rank 0, 2 for 1, 1 for 2
    await subscription.aclose()
    by_rank: dict[int, set[int]] = {}
    for message in parts:
        rank = message.batch.data_parallel_rank
        by_rank.setdefault(rank, set()).update(apply_messages([message]))
    assert [m.batch.snapshot.index for m in parts] == [0, 1, 2, 3, 4]
    assert [m.batch.snapshot.last for m in parts] == [False, False, False, False, True]
    assert [m.batch.data_parallel_rank for m in parts] == [0, 0, 1, 1, 2]
    firsts = [
        len(m.batch.events) > 0 and m.batch.events[0].WhichOneof("event") == "cleared"
        for m in parts
    ]
    assert firsts == [True, False, True, False, True]
    assert by_rank[0] == {2, 3} and by_rank[1] == {1, 7} and by_rank[2] == set()


async def test_subscribers_of_one_snapshot_share_its_messages() -> None:
    hub = KvEventHub("inst", replay_batches=16, snapshot_chunk_blocks=256)
    hub.publish(batch(stored(list(range(1, 600)))))
    first = hub.subscribe(pb.SubscribeKvEventsRequest(include_snapshot=True))
    second = hub.subscribe(pb.SubscribeKvEventsRequest(include_snapshot=True))
    a, b = await take(first, 3), await take(second, 3)
    assert all(x is y for x, y in zip(a, b, strict=True))  # one encoding, shared
    await first.aclose()
    await second.aclose()
