"""The bridge's link catches up before serving (``bridge/engine_link.py`` with
``bridge/catch_up.py``): its start returns, so Dynamo registers the worker, only
once the engine server serves the committed weights, and after a restart it stays
out of the pool until then. A sim engine server in this process (real gRPC,
``--start-paused`` as a training fleet runs it) and the record in a file store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from bridge import metrics
from bridge.config import MODEL_FILES, BridgeConfig, parse_args
from bridge.engine_link import EngineLink
from bridge.registration import Registration
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import InProcessServer
from harness.ports import free_port
from harness.waits import wait_until_async
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
    PushedSource,
)
from rl_client.refit import EngineRefitClient

NAMESPACE = "nscatchup"


def refit_state(address: str) -> pb.RefitState:
    with grpc.insecure_channel(address) as channel:
        load = pb_grpc.EngineServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
        return load.refit_state


class Recording(Registration):
    """The worker's place in the pool, with the engine's version at every rejoin
    (before the endpoint exists, as during the bridge's start, only the flag moves)."""

    def __init__(self, address: str) -> None:
        super().__init__("file")
        self.address = address
        self.moves: list[tuple[str, str]] = []

    def _version(self) -> str:
        try:
            return refit_state(self.address).weight_version
        except grpc.RpcError:
            return "down"

    async def leave(self, reason: str) -> None:
        self.moves.append(("leave", self._version()))
        await super().leave(reason)

    async def rejoin(self, reason: str) -> None:
        self.moves.append(("rejoin", self._version()))
        await super().rejoin(reason)


@dataclass
class Engine:
    model_dir: Path
    address: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    server: InProcessServer | None = None

    def start(self) -> None:
        """A fresh engine server on the address: its start weights, paused."""
        backend = SimBackend(model=str(self.model_dir), zero_delay=True)
        config = ServerConfig(listen=self.address, start_paused=True)
        self.server = InProcessServer(backend, config).start()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


@pytest.fixture
def engine(model_dir: Path) -> Iterator[Engine]:
    served = Engine(model_dir)
    served.start()
    yield served
    served.stop()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileCommittedStore:
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    return FileCommittedStore(tmp_path, NAMESPACE)


def link_for(address: str, catch_up: bool = True) -> tuple[EngineLink, Recording]:
    config = BridgeConfig(
        engine_address=address,
        model_path="/m",
        connect_timeout_s=10,
        discovery_backend="file",
        namespace=NAMESPACE,
        catch_up=catch_up,
    )
    registration = Recording(address)
    return EngineLink(config, registration), registration


@pytest.fixture
async def closing() -> AsyncIterator[list[EngineLink]]:
    links: list[EngineLink] = []
    yield links
    for link in links:
        await link.stop_following()
        await link.close()


def catch_ups(source: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value("bridge_catch_up_seconds_count", {"source": source}) or 0
    )


def checkpoint_record(version: str = "1") -> CommittedRecord:
    return CommittedRecord(CommittedWeights(version, CheckpointSource(str(tiny_weights_dir(1)))))


async def started_on_the_record(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> tuple[EngineLink, Recording]:
    """A link started once its engine serves the committed checkpoint "1", its moves
    so far forgotten."""
    store.publish(checkpoint_record())
    link, registration = link_for(engine.address)
    closing.append(link)
    await asyncio.wait_for(link.start(1, on_stalled=lambda: None), 30)
    registration.moves.clear()
    return link, registration


async def test_start_returns_once_the_committed_checkpoint_serves(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> None:
    store.publish(checkpoint_record())
    before = catch_ups("checkpoint")
    link, registration = link_for(engine.address)
    closing.append(link)
    await asyncio.wait_for(link.start(1, on_stalled=lambda: None), 30)
    state = refit_state(engine.address)
    assert (state.weight_version, state.weight_version_declared, state.paused) == ("1", True, False)
    assert link.serving and registration.in_pool
    # Out while on its start weights, back once on the committed ones.
    assert registration.moves == [("leave", "default"), ("rejoin", "1")]
    assert catch_ups("checkpoint") == before + 1
    assert metrics.REGISTRY.get_sample_value("bridge_catching_up") == 0


async def test_start_waits_for_the_trainer_to_push_its_weights(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> None:
    store.publish(CommittedRecord(CommittedWeights("1", PushedSource())))
    link, registration = link_for(engine.address)
    closing.append(link)
    start = asyncio.ensure_future(link.start(1, on_stalled=lambda: None))
    try:
        await wait_until_async(lambda: not registration.in_pool, 30, "the gate to hold")
        assert metrics.REGISTRY.get_sample_value("bridge_catching_up") == 1
        assert not start.done() and not link.serving
        async with EngineRefitClient([engine.address]) as trainer:  # the keeper's push
            await trainer.refit("1", tensors=checkpoint_tensors(tiny_weights_dir(1)))
        await asyncio.wait_for(start, 30)
    finally:
        start.cancel()
    assert link.serving and registration.in_pool
    assert registration.moves == [("leave", "default"), ("rejoin", "1")]


async def test_a_restarted_engine_server_is_out_of_the_pool_until_it_caught_up(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> None:
    link, registration = await started_on_the_record(engine, store, closing)
    first = link.instance_id

    # Restarted on its address ("default", paused), down long enough for the watch
    # to see it (a process restart is; a quicker one the KV stream reports).
    engine.stop()
    await wait_until_async(lambda: not link.serving, 30, "the watch to see it down")
    engine.start()
    await wait_until_async(
        lambda: link.instance_id != first and link.serving and registration.in_pool,
        30,
        "the link to catch the new instance up",
        interval=0.02,
    )
    assert refit_state(engine.address).weight_version == "1"
    # Out when it went down (the watch), held on its start weights (the gate),
    # back only on "1".
    assert registration.moves[0] == ("leave", "down")
    assert ("leave", "default") in registration.moves
    assert [v for move, v in registration.moves if move == "rejoin"] == ["1"]


async def test_without_catch_up_the_worker_serves_what_the_engine_has(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> None:
    store.publish(CommittedRecord(CommittedWeights("1", PushedSource())))
    link, registration = link_for(engine.address, catch_up=False)
    closing.append(link)
    await asyncio.wait_for(link.start(1, on_stalled=lambda: None), 30)
    assert refit_state(engine.address).weight_version == "default"
    assert link.serving and registration.in_pool and registration.moves == []


def test_the_command_line_has_it_on_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in MODEL_FILES:
        (tmp_path / name).write_text("{}")
    base = ["--engine", "127.0.0.1:5", "--model-path", str(tmp_path), "--discovery-backend", "file"]
    monkeypatch.delenv("BRIDGE_CATCH_UP", raising=False)
    assert parse_args(base)[0].catch_up
    assert not parse_args([*base, "--no-catch-up"])[0].catch_up
    monkeypatch.setenv("BRIDGE_CATCH_UP", "0")
    assert not parse_args(base)[0].catch_up
    assert parse_args([*base, "--catch-up"])[0].catch_up


async def test_a_restarted_engine_server_that_withholds_its_info_stays_out_until_it_answers(
    engine: Engine, store: FileCommittedStore, closing: list[EngineLink]
) -> None:
    """Health SERVING, but its info not read (GetServerInfo past its deadline, as on
    a loaded host): the link once rejoined at once, on the restarted engine's start
    weights, before it knew a catch-up was due."""
    link, registration = await started_on_the_record(engine, store, closing)
    first = link.instance_id
    client = link.client
    assert client is not None
    answer = client.server_info
    withheld = 0

    async def slow_info() -> pb.GetServerInfoResponse:
        nonlocal withheld
        if withheld < 3:
            withheld += 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return await answer()

    engine.stop()
    await wait_until_async(lambda: not link.serving, 30, "the watch to see it down")
    client.server_info = slow_info  # type: ignore[method-assign]
    engine.start()
    await wait_until_async(
        lambda: link.instance_id != first and registration.in_pool,
        30,
        "the link to catch the new instance up",
        interval=0.02,
    )
    assert withheld == 3
    assert refit_state(engine.address).weight_version == "1"
    assert [v for move, v in registration.moves if move == "rejoin"] == ["1"], registration.moves
