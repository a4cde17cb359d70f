"""The trainer's keeper (``rl_client/keeper.py``): an engine server that restarts
after a refit pushed the fleet's weights gets them pushed again, under the lock the
refits take, and so does one whose weights an unfinished update left mixed under the
committed label. Two sim engine servers in this process (real gRPC), one restarted
on its address (``--start-paused``, as a training fleet runs them)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.refit import TensorSpec, WeightWriter
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import InProcessServer, greedy_rollout, nothing, tokens_and_logprobs
from harness.ports import free_port
from harness.waits import wait_until_async
from rl_client.committed import CommittedWeights, PushedSource
from rl_client.keeper import WeightKeeper
from rl_client.refit import EngineRefitClient

PROMPT = [(i * 37) % 800 + 5 for i in range(24)]


class Counting(SimBackend):
    """The sim, counting its streamed updates; ``hold`` keeps the next one waiting."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model=str(model_dir), zero_delay=True, eos_rate=0.0)
        self.updates = 0
        self.hold = threading.Event()
        self.hold.set()

    async def begin_tensor_update(
        self, tensors: Sequence[TensorSpec], *, allow_partial: bool
    ) -> WeightWriter:
        self.updates += 1
        await asyncio.to_thread(self.hold.wait)
        return await super().begin_tensor_update(tensors, allow_partial=allow_partial)


@dataclass
class Pair:
    model_dir: Path
    addresses: list[str]
    servers: list[InProcessServer]
    backends: list[Counting]

    def start(self, i: int, *, paused: bool = False) -> None:
        backend = Counting(self.model_dir)
        config = ServerConfig(listen=self.addresses[i], start_paused=paused)
        server = InProcessServer(backend, config).start()
        if len(self.servers) > i:
            self.servers[i], self.backends[i] = server, backend
        else:
            self.servers.append(server)
            self.backends.append(backend)

    def restart(self, i: int) -> None:
        """A new engine server on the same address: its start weights, paused."""
        self.servers[i].stop()
        self.start(i, paused=True)

    def state(self, i: int) -> pb.RefitState:
        with grpc.insecure_channel(self.addresses[i]) as channel:
            load = pb_grpc.EngineServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
            return load.refit_state

    def output(self, i: int) -> tuple[list[int], list[float]]:
        with grpc.insecure_channel(self.addresses[i]) as channel:
            answer = greedy_rollout(pb_grpc.EngineServiceStub(channel), PROMPT, 12, timeout=30)
            return tokens_and_logprobs(answer)


@pytest.fixture
def pair(model_dir: Path) -> Iterator[Pair]:
    fleet = Pair(model_dir, [f"127.0.0.1:{free_port()}" for _ in range(2)], [], [])
    try:
        for i in range(2):
            fleet.start(i)
        yield fleet
    finally:
        for server in fleet.servers:
            server.stop()


@pytest_asyncio.fixture
async def trainer(pair: Pair) -> AsyncIterator[EngineRefitClient]:
    async with EngineRefitClient(pair.addresses) as client:
        yield client


async def test_a_restarted_engine_gets_the_pushed_weights_again(
    pair: Pair, trainer: EngineRefitClient
) -> None:
    keeper = WeightKeeper(trainer, interval_s=0.05)
    try:
        assert await keeper.check() == []  # nothing committed: nothing to keep
        await trainer.refit("1", tensors=checkpoint_tensors(tiny_weights_dir(1)))
        served = pair.output(0)
        assert pair.output(1) == served
        assert await keeper.check() == []  # every engine serves "1"

        pair.restart(1)
        restarted = pair.state(1)
        assert (restarted.weight_version_declared, restarted.paused) == (False, True)
        keeper.start()
        await wait_until_async(lambda: keeper.pushes == 1, 30, "the keeper's push")
        state = pair.state(1)
        assert (state.weight_version, state.weight_version_declared) == ("1", True)
        assert not state.paused  # resumed by the push
        assert pair.output(1) == served  # the very weights the fleet serves
        assert keeper.last_push_s is not None and keeper.last_push_s > 0
        assert await keeper.check() == [] and keeper.pushes == 1
        assert pair.backends[0].updates == 1  # the other engine was left alone
    finally:
        await keeper.close()


async def test_a_push_waits_for_the_refit_in_progress_and_is_checked_again(
    pair: Pair, trainer: EngineRefitClient
) -> None:
    await trainer.refit("1", tensors=checkpoint_tensors(tiny_weights_dir(1)))
    pair.restart(1)
    pair.backends[0].hold.clear()  # the next refit stops in engine 0's load
    refit = asyncio.ensure_future(
        trainer.refit("2", tensors=checkpoint_tensors(tiny_weights_dir(2)))
    )
    await wait_until_async(lambda: pair.backends[0].updates == 1, 30, "the refit loading")
    keeper = WeightKeeper(trainer)
    restores: list[bool] = []
    restore = trainer.restore

    async def spied(worker: str, *, mode: str = "abort") -> bool:
        restores.append(False)  # called: the keeper saw engine 1 lag
        done = await restore(worker, mode=mode)
        restores[-1] = done
        return done

    trainer.restore = spied  # type: ignore[method-assign]
    try:
        check = asyncio.ensure_future(keeper.check())
        await wait_until_async(lambda: restores, 30, "the keeper to see engine 1 lag")
        assert not check.done()  # waiting for the refit's lock
        pair.backends[0].hold.set()
        await refit
        assert await check == [] and restores == [False]  # the refit brought it to "2"
        assert pair.backends[1].updates == 1  # the refit's load only, no push on top
        assert pair.state(1).weight_version == "2" and keeper.pushes == 0
    finally:
        pair.backends[0].hold.set()
        await keeper.close()


async def test_weights_an_unfinished_update_left_mixed_are_pushed_whole_again(
    pair: Pair, trainer: EngineRefitClient
) -> None:
    """Engine 1 keeps the committed label, but a weight-transfer update that ended
    after its rounds (its trainer gone; an engine that cannot roll back) left its
    weights part old, part new (revision 12's ``weights_mixed``): pushed again,
    whole. While that update was part way, it was left to its writer."""
    await trainer.refit("1", tensors=checkpoint_tensors(tiny_weights_dir(1)))
    served = pair.output(0)
    for step in ("start_weight_update", "update_weights", "shutdown_weight_transfer"):
        setattr(pair.backends[1], step, nothing)
    keeper = WeightKeeper(trainer)
    try:
        with grpc.insecure_channel(pair.addresses[1]) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
            stub.StartWeightUpdate(pb.StartWeightUpdateRequest(), timeout=10)
            stub.UpdateWeights(pb.UpdateWeightsRequest(update_info_json=b"{}"), timeout=10)
            part_way = pair.state(1)
            assert part_way.weight_update_open and "part way" in part_way.weights_mixed
            assert await keeper.check() == [] and keeper.errors == {}  # not even tried
            with pytest.raises(ValueError, match=r"has a weight-transfer update open \(a w"):
                await trainer.restore(pair.addresses[1])
            stub.ShutdownWeightTransferEngine(pb.ShutdownWeightTransferEngineRequest(), timeout=10)
        mixed = pair.state(1)
        assert (mixed.weight_version, mixed.weight_version_declared, mixed.paused) == (
            "1",
            True,
            True,
        )
        assert "ended unfinished" in mixed.weights_mixed and not mixed.weight_update_open
        assert pair.backends[1].updates == 1  # the refit's
        assert await keeper.check() == [pair.addresses[1]]
        state = pair.state(1)
        assert (state.weight_version, state.weights_mixed, state.paused) == ("1", "", False)
        assert pair.backends[1].updates == 2 and pair.backends[0].updates == 1
        assert pair.output(1) == served
        assert await keeper.check() == []
    finally:
        await keeper.close()


async def test_a_lagging_engine_with_an_update_open_is_left_to_its_writer(
    pair: Pair, trainer: EngineRefitClient
) -> None:
    """Restarted, then a writer started an update on it (no round yet): the engine
    refuses a push under it. Once the update ends, the push comes."""
    await trainer.refit("1", tensors=checkpoint_tensors(tiny_weights_dir(1)))
    pair.restart(1)
    for step in ("start_weight_update", "shutdown_weight_transfer"):
        setattr(pair.backends[1], step, nothing)
    keeper = WeightKeeper(trainer)
    try:
        with grpc.insecure_channel(pair.addresses[1]) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            stub.StartWeightUpdate(pb.StartWeightUpdateRequest(), timeout=10)
            assert await keeper.check() == [] and keeper.errors == {}
            with pytest.raises(ValueError, match=r"open \(no UpdateWeights round sent yet\)"):
                await trainer.restore(pair.addresses[1])
            stub.ShutdownWeightTransferEngine(pb.ShutdownWeightTransferEngineRequest(), timeout=10)
        assert await keeper.check() == [pair.addresses[1]]
        assert pair.state(1).weight_version == "1" and pair.backends[1].updates == 1
    finally:
        await keeper.close()


async def test_weights_it_cannot_send_again_are_not_kept(pair: Pair) -> None:
    # What a restarted trainer knows from the store: the version, not the tensors.
    committed = CommittedWeights("1", PushedSource())
    async with EngineRefitClient(pair.addresses, committed=committed) as trainer:
        keeper = WeightKeeper(trainer)
        try:
            assert await keeper.check() == []
            with pytest.raises(ValueError, match="send again"):
                await trainer.restore(pair.addresses[0])
        finally:
            await keeper.close()
