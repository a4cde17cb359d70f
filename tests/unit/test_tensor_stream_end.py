"""A tensor stream's end, said (contract revision 13): a stream whose manifest
announces its ``end`` message commits on it, with no wait; one that ends without
it loads nothing; an ``end`` before the last byte, or a message after it, is
refused by name. A stream with no marker (a revision-12 client) still waits
``END_SETTLE_S`` at its end. ``EngineRefitClient`` sends the marker to servers of
revision 13 and later only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine_contract
from engine_contract.tensors import Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_server import refit_requests
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from engine_server.core import ServerCore
from engine_server.errors import InvalidRequest
from engine_server.refit_requests import update_from_tensors
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import InProcessServer, aiter_of
from rl_client.refit import EngineRefitClient


async def core_of(model_dir: Path) -> ServerCore:
    backend = SimBackend(zero_delay=True, eos_rate=0.0, model=str(model_dir))
    core = ServerCore(backend, ServerConfig(listen="127.0.0.1:0"), "inst")
    await core.start_engine()
    return core


def checkpoint() -> list[Tensor]:
    return checkpoint_tensors(tiny_weights_dir(1))


def marked(tensors: list[Tensor]) -> list[pb.UpdateWeightsFromTensorsRequest]:
    requests = list(update_requests(tensors, allow_unpaused=True, end_marker=True))
    assert requests[0].manifest.ends_with_marker and requests[-1].WhichOneof("part") == "end"
    return requests


async def changes(core: ServerCore) -> int:
    return core.refit.state().weight_changes


async def test_a_marked_stream_commits_at_its_end_message_without_the_settle(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(refit_requests, "END_SETTLE_S", 30.0)  # would time the test out
    core = await core_of(model_dir)
    try:
        before = await changes(core)
        answer = await asyncio.wait_for(
            update_from_tensors(core, aiter_of(marked(checkpoint()))), 10
        )
        assert answer.result.tensors == len(checkpoint())
        assert await changes(core) == before + 1
    finally:
        await core.backend.shutdown()


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        # Every chunk, no end message: the client died before it (or forgot it).
        (lambda r: r[:-1], r"without the end message its manifest announced.*nothing was loaded"),
        # The end message after the first chunk only.
        (lambda r: [*r[:2], r[-1]], r"came to its end message short.*nothing was loaded"),
        # A chunk after the end message.
        (lambda r: [*r, r[1]], r"a message came after the end message"),
    ],
    ids=["no-end", "end-early", "after-end"],
)
async def test_a_marked_stream_that_ends_otherwise_loads_nothing(
    model_dir: Path, cut: Any, match: str
) -> None:
    core = await core_of(model_dir)
    try:
        before = await changes(core)
        with pytest.raises(InvalidRequest, match=match):
            await asyncio.wait_for(
                update_from_tensors(core, aiter_of(cut(marked(checkpoint())))), 10
            )
        assert await changes(core) == before
        assert core.refit.broken is None and not core.refit.state().weights_mixed
    finally:
        await core.backend.shutdown()


async def test_an_unmarked_stream_still_waits_at_its_end(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(refit_requests, "END_SETTLE_S", 0.5)
    core = await core_of(model_dir)
    try:
        requests = list(update_requests(checkpoint(), allow_unpaused=True))
        assert not requests[0].manifest.ends_with_marker
        assert all(r.WhichOneof("part") != "end" for r in requests)
        started = time.monotonic()
        await asyncio.wait_for(update_from_tensors(core, aiter_of(requests)), 10)
        assert time.monotonic() - started >= 0.5
    finally:
        await core.backend.shutdown()


@pytest.fixture
def spied(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[bool]]]:
    """An in-process server, and whether each tensor stream it read was marked."""
    seen: list[bool] = []
    original = refit_requests._Chunks.__init__

    def spy(self: Any, messages: Any, specs: Any, *, marked: bool) -> None:
        seen.append(marked)
        original(self, messages, specs, marked=marked)

    monkeypatch.setattr(refit_requests._Chunks, "__init__", spy)
    backend = SimBackend(zero_delay=True, eos_rate=0.0, model=str(model_dir))
    server = InProcessServer(backend, ServerConfig(listen="127.0.0.1:0")).start()
    try:
        yield server.address, seen
    finally:
        server.stop()


@pytest.mark.parametrize("revision", [12, 13])
async def test_the_refit_client_marks_its_stream_for_servers_that_take_the_end(
    spied: tuple[str, list[bool]], revision: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, seen = spied
    monkeypatch.setattr(engine_contract, "CONTRACT_REVISION", revision)  # what the server says
    async with EngineRefitClient([address]) as client:
        await client.refit("1", tensors=checkpoint())
    assert seen == [revision >= engine_contract.TENSOR_STREAM_END_REVISION]
