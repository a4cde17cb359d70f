"""The cache salt (revision 11): a salted prompt's blocks are found only under its
salt, by Generate and Rollout alike; the salt changes no token and no logprob; the
KV events of a salted chain name its salt; a bad salt is refused by name (the
bad-input cases in test_bad_input.py)."""

from __future__ import annotations

import struct

from engine_contract.v1 import engine_pb2 as pb
from tests.conformance.common import StreamResult, collect, make_prompt, new_id
from tests.conformance.test_kv_events import Subscriber


async def generate(stub, prompt: list[int], salt: str | None = None) -> StreamResult:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(request_id=new_id("salt"), prompt_token_ids=prompt)
    request.sampling.temperature = 0.0
    request.stop.max_tokens = 3
    request.stop.ignore_eos = True
    request.output.logprobs = 0
    if salt is not None:
        request.cache_salt = salt
    return await collect(stub, request)


def cached(result: StreamResult) -> int:
    return result.finished.usage.cached_prompt_tokens


def same_output(a: StreamResult, b: StreamResult) -> bool:
    """The same tokens and the same logprobs to the bit."""
    pack = [struct.pack("<d", v) for v in a.logprobs]
    return a.token_ids == b.token_ids and pack == [struct.pack("<d", v) for v in b.logprobs]


async def test_a_salted_prompt_is_found_only_under_its_salt(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    size = server_info.engine_config.kv_block_size
    prompt = make_prompt(server_info, 2 * size + 3, seed=7100)
    plain = await generate(stub, prompt)
    plain_again = await generate(stub, prompt)
    hit = cached(plain_again)  # what a repeat finds here (0: an engine with no prefix cache)
    salted = await generate(stub, prompt, "tenant-a")
    assert cached(salted) == 0  # not the unsalted blocks
    salted_again = await generate(stub, prompt, "tenant-a")
    assert cached(salted_again) == hit
    other = await generate(stub, prompt, "tenant-b")
    assert cached(other) == 0
    # A prompt run first salted is not found unsalted either.
    fresh = make_prompt(server_info, 2 * size + 3, seed=7101)
    await generate(stub, fresh, "tenant-a")
    assert cached(await generate(stub, fresh)) == 0
    # Nothing generated depends on the salt: runs that found as much in the cache
    # give the same bits.
    assert same_output(salted, plain) and same_output(other, plain)
    assert same_output(salted_again, plain_again)


async def test_rollouts_and_generates_share_a_salt(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    size = server_info.engine_config.kv_block_size
    prompt = make_prompt(server_info, 2 * size + 3, seed=7102)
    first = await generate(stub, prompt, "tenant-c")
    assert cached(first) == 0
    hit = cached(await generate(stub, prompt, "tenant-c"))

    async def rollout(salt: str) -> int:
        answer = await stub.Rollout(
            pb.RolloutRequest(
                request_id=new_id("salt"),
                prompt_token_ids=prompt,
                greedy=True,
                max_new_tokens=2,
                cache_salt=salt,
            )
        )
        return int(answer.usage.cached_prompt_tokens)

    assert await rollout("tenant-c") == hit
    assert await rollout("tenant-d") == 0


async def test_a_salted_chain_names_its_salt_in_its_kv_events(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    size = server_info.engine_config.kv_block_size
    prompt = make_prompt(server_info, 3 * size + 3, seed=7103)
    blocks = {tuple(prompt[i * size : (i + 1) * size]) for i in range(3)}
    sub = await Subscriber(stub, pb.SubscribeKvEventsRequest()).started()
    try:
        await generate(stub, prompt)
        await generate(stub, prompt, "tenant-e")
        await generate(stub, prompt, "tenant-e")  # its cached chain is not stored again
        if not cached(await generate(stub, prompt)):
            return  # an engine with no prefix cache publishes no blocks to check

        def salts() -> dict[str, list[tuple[int, ...]]]:
            by_salt: dict[str, list[tuple[int, ...]]] = {}
            for batch in sub.batches:
                for event in batch.events:
                    if event.WhichOneof("event") != "stored":
                        continue
                    stored = event.stored
                    for i in range(len(stored.block_hashes)):
                        tokens = tuple(stored.token_ids[i * size : (i + 1) * size])
                        if tokens in blocks:
                            by_salt.setdefault(stored.cache_salt, []).append(tokens)
            return by_salt

        await sub.wait_for(lambda: all(len(salts().get(s, ())) >= 3 for s in ("", "tenant-e")))
        by_salt = salts()
        # Each chain stored once, the salted one under its salt, every block of it.
        assert sorted(by_salt) == ["", "tenant-e"], by_salt
        assert set(by_salt["tenant-e"]) == blocks and len(by_salt["tenant-e"]) == 3
        assert set(by_salt[""]) == blocks and len(by_salt[""]) == 3
    finally:
        await sub.close()
