"""Paced completions (contract revision 6): the bridge reports each delta taken as
it hands it on, so a slow consumer gets a few large deltas instead of one per
token, against a real sim engine server over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bridge import metrics
from bridge.client import ClientOptions, EngineClient
from engine_contract.v1 import engine_pb2 as pb
from harness.engine import InProcessServer, sim_cli_args

TOKENS = 60


@pytest.fixture(scope="module")
def sim() -> Iterator[InProcessServer]:
    # 1 ms per engine step: the engine makes tokens ten times faster than the
    # consumer below takes them.
    server = InProcessServer.from_cli(
        *sim_cli_args("--decode-step-ms", "1", "--eos-rate", "0")
    ).start()
    yield server
    server.stop()


async def client_for(address: str, paced: bool) -> EngineClient:
    client = EngineClient(address, ClientOptions(paced_generates=paced))
    client.use_server_limits(await client.wait_ready(10))
    return client


def completion(request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8])
    request.sampling.temperature = 0.0
    request.stop.max_tokens = TOKENS
    request.output.logprobs = 0
    return request


def deltas_received() -> float:
    """Deltas the bridge has received on Generates streams (its own metric)."""
    value = metrics.REGISTRY.get_sample_value(
        "bridge_engine_stream_items_per_message_sum",
        {"stream": "completions", "direction": "received"},
    )
    return value or 0.0


async def consume(
    client: EngineClient, request: pb.GenerateRequest
) -> tuple[list[int], list[float], int]:
    tokens: list[int] = []
    logprobs: list[float] = []
    chunks = 0
    async for delta in client.stream_generate(request):
        chunks += 1
        tokens.extend(delta.token_ids)
        logprobs.extend(delta.logprobs)
        await asyncio.sleep(0.01)  # the consumer's own work per chunk
    return tokens, logprobs, chunks


async def slow_consumers(client: EngineClient, name: str) -> tuple[float, int]:
    """Four completions consumed at 10 ms per chunk, their tokens equal to a Generate
    call's; the deltas the bridge received for them, and the chunks taken."""
    before = deltas_received()
    results = await asyncio.gather(*(consume(client, completion(f"{name}-{i}")) for i in range(4)))
    delivered = deltas_received() - before
    for i, (tokens, logprobs, _) in enumerate(results):
        unary = [m async for m in client.generate(completion(f"{name}-unary-{i}"))]
        assert tokens == [t for m in unary for t in m.token_ids] and len(tokens) == TOKENS
        assert logprobs == [lp for m in unary for lp in m.logprobs]
    return delivered, sum(chunks for _, _, chunks in results)


async def test_a_paced_stream_sends_a_delta_per_chunk_taken(sim: InProcessServer) -> None:
    client = await client_for(sim.address, paced=True)
    try:
        assert client.paced_generates
        delivered, chunks = await slow_consumers(client, "paced")
        # One delta on its way at a time: nothing piles up in the bridge.
        assert delivered == chunks
        assert chunks <= TOKENS  # 4 completions' 240 tokens, ~10 per 10 ms taken
    finally:
        await client.close()


async def test_unpaced_deltas_come_as_the_engine_makes_them(sim: InProcessServer) -> None:
    client = await client_for(sim.address, paced=False)
    try:
        assert not client.paced_generates
        delivered, chunks = await slow_consumers(client, "unpaced")
        # Many more deltas than the consumer took (merged in the bridge).
        assert delivered >= 2 * chunks
    finally:
        await client.close()
