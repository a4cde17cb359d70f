"""SubscribeKvEvents: order, content, resume, snapshots, reset."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from tests.conformance.common import make_prompt, new_id


class Subscriber:
    """Reads a subscription in the background and applies it to a block set."""

    def __init__(self, stub, request: pb.SubscribeKvEventsRequest) -> None:  # type: ignore[no-untyped-def]
        self.call = stub.SubscribeKvEvents(request)
        self.batches: list[pb.KvEventBatch] = []
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, int | None] = {}
        self.unknown_removals = 0
        self.changed = asyncio.Event()
        self.messages = 0
        self.task = asyncio.ensure_future(self._run())

    async def started(self) -> Subscriber:
        """Wait for the headers: from then on no batch is missed."""
        await asyncio.wait_for(self.call.initial_metadata(), 10)
        return self

    async def _run(self) -> None:
        async for message in self.call:
            self.messages += 1
            for batch in message.batches if len(message.batches) else (message.batch,):
                self._apply(batch)
            self.changed.set()

    def _apply(self, batch: pb.KvEventBatch) -> None:
        self.batches.append(batch)
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                stored = event.stored
                parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
                size = stored.block_size
                for i, block_hash in enumerate(stored.block_hashes):
                    self.blocks[block_hash] = tuple(stored.token_ids[i * size : (i + 1) * size])
                    self.parents[block_hash] = parent
                    parent = block_hash
            elif kind == "removed":
                for block_hash in event.removed.block_hashes:
                    if self.blocks.pop(block_hash, None) is None:
                        self.unknown_removals += 1
            else:
                self.blocks.clear()

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)

    def live(self) -> list[pb.KvEventBatch]:
        return [b for b in self.batches if not b.HasField("snapshot")]

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def run_prompts(
    stub, info: pb.GetServerInfoResponse, blocks: int, seeds: range
) -> list[list[int]]:  # type: ignore[no-untyped-def]
    size = info.engine_config.kv_block_size
    prompts = [make_prompt(info, blocks * size + 3, seed) for seed in seeds]
    await asyncio.gather(
        *(
            stub.Rollout(
                pb.RolloutRequest(
                    request_id=new_id("kv"), prompt_token_ids=p, greedy=True, max_new_tokens=2
                )
            )
            for p in prompts
        )
    )
    return prompts


async def run_prompts_one_by_one(
    stub, info: pb.GetServerInfoResponse, blocks: int, seeds: range
) -> None:  # type: ignore[no-untyped-def]
    """One prompt at a time: each is prefilled in its own engine step, so each
    stores its blocks in its own batch (prompts sent together may share one)."""
    for seed in seeds:
        await run_prompts(stub, info, blocks, range(seed, seed + 1))


def prompt_stored(sub: Subscriber, prompt: list[int], size: int, blocks: int) -> bool:
    wanted = {tuple(prompt[i * size : (i + 1) * size]) for i in range(blocks)}
    return wanted <= set(sub.blocks.values())


async def test_stored_blocks_chain_and_sequence_numbers(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    size = server_info.engine_config.kv_block_size
    sub = Subscriber(stub, pb.SubscribeKvEventsRequest(include_snapshot=True))
    try:
        (prompt,) = await run_prompts(stub, server_info, 3, range(900, 901))
        await sub.wait_for(lambda: prompt_stored(sub, prompt, size, 3))
        # The prompt's blocks form a chain: each one's parent is the previous.
        by_tokens = {tokens: h for h, tokens in sub.blocks.items()}
        chain = [by_tokens[tuple(prompt[i * size : (i + 1) * size])] for i in range(3)]
        assert sub.parents[chain[1]] == chain[0] and sub.parents[chain[2]] == chain[1]
        seqs = [b.sequence_number for b in sub.batches]
        snapshot_seq = sub.batches[0].sequence_number
        live = [b.sequence_number for b in sub.live()]
        assert live == list(range(snapshot_seq + 1, snapshot_seq + 1 + len(live)))
        assert seqs == sorted(seqs)
        assert {b.instance_id for b in sub.batches} == {server_info.instance_id}
        assert all(b.timestamp_unix_nanos > 0 for b in sub.live())
        assert sub.unknown_removals == 0
    finally:
        await sub.close()


async def test_snapshot_plus_live_equals_a_later_snapshot(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    sub = Subscriber(stub, pb.SubscribeKvEventsRequest(include_snapshot=True))
    try:
        await run_prompts(stub, server_info, 2, range(910, 930))
        probe = pb.SubscribeKvEventsRequest(include_snapshot=True)
        for _ in range(50):
            later = Subscriber(stub, probe)
            await later.wait_for(
                lambda later=later: any(
                    b.snapshot.last for b in later.batches if b.HasField("snapshot")
                )
            )
            await later.close()
            snapshot_seq = later.batches[0].sequence_number
            # Compare at the same position: wait until the first subscriber got there.
            await sub.wait_for(lambda seq=snapshot_seq: sub.batches[-1].sequence_number >= seq)
            if sub.batches[-1].sequence_number == snapshot_seq:
                assert sub.blocks == later.blocks
                assert sub.unknown_removals == 0 and later.unknown_removals == 0
                return
            await asyncio.sleep(0.05)  # events still flowing; try again
        pytest.fail("the KV-event stream never settled")
    finally:
        await sub.close()


async def test_resume_from_sequence_number_replays_exactly(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    sub = await Subscriber(stub, pb.SubscribeKvEventsRequest()).started()
    try:
        await run_prompts_one_by_one(stub, server_info, 2, range(940, 944))
        await sub.wait_for(lambda: len(sub.batches) >= 2)
        start = sub.batches[1].sequence_number
        resumed = Subscriber(
            stub,
            pb.SubscribeKvEventsRequest(
                start_sequence_number=start, expected_instance_id=server_info.instance_id
            ),
        )
        await run_prompts(stub, server_info, 2, range(944, 946))
        await resumed.wait_for(
            lambda: (
                resumed.batches
                and sub.batches
                and resumed.batches[-1].sequence_number >= sub.batches[-1].sequence_number
            )
        )
        await resumed.close()
        by_seq = {b.sequence_number: b for b in sub.batches}
        got = resumed.batches
        assert got[0].sequence_number == start
        assert [b.sequence_number for b in got] == list(range(start, start + len(got)))
        for batch in got:
            if batch.sequence_number in by_seq:
                assert batch == by_seq[batch.sequence_number]
    finally:
        await sub.close()


@pytest.mark.parametrize("position", ["future", "other instance"])
async def test_unservable_position_is_an_error_or_a_snapshot(
    stub, server_info, position: str
) -> None:  # type: ignore[no-untyped-def]
    request = pb.SubscribeKvEventsRequest(start_sequence_number=1)
    if position == "future":
        request.start_sequence_number = 2**62
    else:
        request.expected_instance_id = "a-previous-instance"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.SubscribeKvEvents(request):
            break
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "start_sequence_number" in err.value.details() or "instance" in err.value.details()
    request.snapshot_if_unavailable = True
    async for message in stub.SubscribeKvEvents(request):
        assert message.batch.HasField("snapshot") and message.batch.snapshot.index == 0
        assert message.batch.events[0].WhichOneof("event") == "cleared"
        break


async def test_reset_prefix_cache_emits_all_cleared(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    size = server_info.engine_config.kv_block_size
    sub = await Subscriber(stub, pb.SubscribeKvEventsRequest()).started()
    try:
        (prompt,) = await run_prompts(stub, server_info, 2, range(960, 961))
        await sub.wait_for(lambda: prompt_stored(sub, prompt, size, 2))
        await stub.Abort(pb.AbortRequest(all=True))
        answer = await stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
        assert answer.reset
        # Engines may report the clear at their next step (vLLM does): give them one.
        await run_prompts(stub, server_info, 0, range(961, 962))

        def cleared() -> bool:
            return any(e.WhichOneof("event") == "cleared" for b in sub.batches for e in b.events)

        await sub.wait_for(cleared)
        assert not prompt_stored(sub, prompt, size, 2)
    finally:
        await sub.close()


async def test_packed_batches_equal_one_per_message(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    """max_batches_per_message > 1: the same batches, in order, in fewer messages."""
    single = await Subscriber(stub, pb.SubscribeKvEventsRequest()).started()
    packed = await Subscriber(
        stub, pb.SubscribeKvEventsRequest(max_batches_per_message=64, max_delay_ms=20)
    ).started()
    try:
        await run_prompts_one_by_one(stub, server_info, 2, range(980, 986))
        await single.wait_for(lambda: len(single.batches) >= 2)
        last = single.batches[-1].sequence_number
        await packed.wait_for(
            lambda: bool(packed.batches) and packed.batches[-1].sequence_number >= last
        )
        assert packed.messages <= len(packed.batches)
        by_seq = {b.sequence_number: b for b in single.batches}
        seqs = [b.sequence_number for b in packed.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        for batch in packed.batches:
            if batch.sequence_number in by_seq:
                assert batch == by_seq[batch.sequence_number]
    finally:
        await single.close()
        await packed.close()
