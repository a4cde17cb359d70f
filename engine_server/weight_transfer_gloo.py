"""``gloo``: vLLM's dense NCCL weight-transfer protocol over torch.distributed gloo (TCP).

NeMo RL refits vLLM workers only through vLLM's weight-transfer framework, whose
engines all need GPUs (NCCL, CUDA IPC). This backend speaks the same protocol on
any machine, so the whole handshake (init, start, update, finish) runs on CPUs, in
CI, and across hosts without NCCL:

- worker side, ``GlooWeightTransferEngine``: vLLM's ``NCCLWeightTransferEngine``
  with the communicator swapped. It joins the trainer's group at rank
  ``rank_offset`` + its own index across data-parallel replicas (so one group
  serves several workers: worker i of a fleet joins at ``rank_offset`` = trainer
  world size + i, as NeMo RL's does), receives the packed buffers and applies them
  through the model's ``load_weights`` between the layerwise-reload start and
  finish that the NCCL engine uses: after start, update, finish the engine serves
  the new weights exactly.
- trainer side, ``GlooTrainerWeightTransferEngine``: vLLM's
  ``NCCLTrainerWeightTransferEngine`` (its ``send_weights`` round trip and source
  checks) with rank 0 opened on gloo. Imports only torch and vLLM, so a trainer
  can use it without the engine server's dependencies.

This module is the engines; their parts are ``engine_server.gloo``: how tensors
travel (``packing``: vLLM's chunks, cut finer into broadcasts, a window ahead),
the bounded rendezvous (``rendezvous``), an update rolled back (``rollback``) and
what the engine server and a worker tell each other (``protocol``).

Init info keys (worker side; the trainer's ``GlooTrainerInitInfo`` takes NCCL's
``master_address``, ``master_port``, ``world_size``, keyword ``rank`` and packing
options, and sends the worker's): ``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``packed``, ``packed_buffer_size_bytes``,
``packed_num_buffers`` and ``timeout_s`` (default 30), which bounds the
rendezvous and each broadcast after it, whatever the peer does. Update info:
NCCL's ``names``, ``dtype_names``, ``shapes``, and optionally the packing options
per round (``"packed": true``, as trainers written for older vLLM send them).

An update that ends before its finish (its trainer killed mid-broadcast, a round
past ``timeout_s``, an update info refused, or ``ABANDON_KEY``: the engine server
ending an update whose trainer went away between rounds) is rolled back and the
old weights serve bit for bit; the trainer's group is shut down. The engine
server reads which of these failures happened from the error's text
(``protocol.transfer_failure``): vLLM passes a worker's error on as text only.

Registered under ``gloo`` in both of vLLM's factories by the engine server's vLLM
plugin (``engine_server.vllm_plugin.register_gloo_weight_transfer``), which vLLM
loads in every process; a trainer gets it from ``vllm.plugins.load_general_plugins()``.
Select it with ``--weight-transfer-config '{"backend": "gloo"}'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar, NoReturn

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
)

from engine_server.gloo.packing import (
    SRC,
    buffer_bytes,
    chunk_layout,
    receive_packed,
    send_packed,
)
from engine_server.gloo.protocol import (
    ABANDON_KEY,
    BACKEND,
    UpdateLeftPartWay,
    UpdateRolledBack,
    first_line,
)
from engine_server.gloo.rendezvous import DEFAULT_TIMEOUT_S, Group, open_group
from engine_server.gloo.rollback import ReloadSnapshot, roll_back
from engine_server.vllm_compat import HAS_TRAINER_ENGINES, mtp_check_disabled

# -- the inference worker's side ----------------------------------------------


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What the worker's ``init_weight_transfer_engine`` takes: NCCL's TCP
    rendezvous fields and packing options, plus ``timeout_s``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be in [1, world_size "
                f"{self.world_size}): rank 0 is the trainer's sender"
            )


@dataclass
class GlooWeightTransferUpdateInfo(NCCLWeightTransferUpdateInfo):
    """NCCL's per-round update info (names, dtype names, shapes). Also takes the
    packing options per round, as vLLM's NCCL engine did before they moved to the
    init info and as trainers written for it (NeMo RL's included) still send them
    (``"packed": true``); given, they win over the init's for this round."""

    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None


def worker_rank(parallel_config: Any, rank_offset: int) -> int:
    """This worker's rank in the trainer's group: its index across data-parallel
    replicas (TP x PP workers each), after the trainer's ``rank_offset`` ranks."""
    index = parallel_config.data_parallel_index * parallel_config.world_size
    return rank_offset + index + parallel_config.rank


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL worker engine with a gloo group: its layerwise-reload start and
    finish are kept; receiving and the group are gloo's."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Group | None = None
        # The update in progress as it started, taken at its first round: what
        # rolling it back restores (``_abandon``).
        self._snapshot: ReloadSnapshot | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        rank = worker_rank(self.parallel_config, init_info.rank_offset)
        if rank >= init_info.world_size:
            raise ValueError(
                f"this worker's rank {rank} is outside world_size {init_info.world_size}"
            )
        self.shutdown()  # a trainer that re-initializes replaces its old group
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        """vLLM 0.32's entry (0.23's worker starts the layerwise reload itself)."""
        self._snapshot = None
        super().start_weight_update()

    def finish_weight_update(self) -> None:
        """vLLM 0.32's entry (0.23's worker finishes the reload itself; a snapshot
        left from it is found stale at the next update)."""
        self._snapshot = None
        super().finish_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM 0.32's entry (0.23's worker calls ``receive_weights`` itself)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # loads went to the device
            torch.accelerator.synchronize()  # (the CPU build has none: it would raise)

    def parse_update_info(self, update_dict: dict[str, Any]) -> GlooWeightTransferUpdateInfo:
        """One round's info; ``ABANDON_KEY`` ends the update instead. Either way an
        error here ends the worker's update (vLLM's worker resets it on any error
        of ``update_weights``), so the update is rolled back first."""
        if ABANDON_KEY in update_dict:
            self._abandon(f"the engine server abandoned it ({update_dict[ABANDON_KEY]})")
        try:
            info: GlooWeightTransferUpdateInfo = super().parse_update_info(update_dict)
        except Exception as e:
            self._abandon(f"its update info was refused ({first_line(e)})")
        return info

    def receive_weights(
        self,
        update_info: GlooWeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ) -> None:
        """``load_weights``: the loader vLLM 0.23's worker hands in; 0.32 leaves it
        to the engine (the model's own). A round that fails (its trainer gone, a
        broadcast past ``timeout_s``, tensors the model refuses) ends the update,
        rolled back: the weights it found serve again."""
        try:
            self._receive(update_info, load_weights)
        except Exception as e:
            self._abandon(f"receiving it failed ({first_line(e)})")

    def _abandon(self, why: str) -> NoReturn:
        """End the update in progress with the weights it found: the trainer's group
        shut down (its collectives are out of step now), the layerwise reload
        rolled back (``UpdateRolledBack``), or, where that cannot be done, the
        weights unknown (``UpdateLeftPartWay``)."""
        with contextlib.suppress(Exception):
            self.shutdown()
        snapshot, self._snapshot = self._snapshot, None
        try:
            restored = roll_back(self.model, snapshot, self._finalize_config())
        except Exception as e:
            raise UpdateLeftPartWay(
                f"{why}; rolling it back failed ({first_line(e)}): the weights are unknown"
            ) from e
        if not restored:
            raise UpdateLeftPartWay(
                f"{why}; what it had loaded could not be rolled back: the weights are unknown"
            )
        raise UpdateRolledBack(
            f"{why}; it was rolled back, the old weights serve; the trainer's group was "
            "shut down: init it again"
        )

    def _finalize_config(self) -> Any:
        """What vLLM's ``finalize_layerwise_reload`` reads of the model config (its
        dtype): 0.32's engine has it, 0.23's is given the model's own dtype."""
        config = getattr(self, "model_config", None)
        if config is not None:
            return config
        dtypes = (p.dtype for p in self.model.parameters() if p.is_floating_point())
        return SimpleNamespace(dtype=next(dtypes, torch.get_default_dtype()))

    def _receive(
        self,
        update_info: GlooWeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None,
    ) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init first")
        if self._snapshot is None or not self._snapshot.current():
            self._snapshot = ReloadSnapshot.take(self.model)  # before anything loads
        load = self.model.load_weights if load_weights is None else load_weights

        def this_round(value: Any, default: Any) -> Any:
            return default if value is None else value

        packed = this_round(update_info.packed, self.packed)
        layout = chunk_layout(
            zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True),
            buffer_bytes(
                packed,
                this_round(update_info.packed_buffer_size_bytes, self.packed_buffer_size_bytes),
            ),
        )
        num_buffers = this_round(update_info.packed_num_buffers, self.packed_num_buffers)
        with mtp_check_disabled():
            receive_packed(self.group, layout, load, num_buffers)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    # vLLM 0.23's trainer API (static, on the worker's engine class: 0.23 has no
    # trainer engines), for a trainer written against it, as NeMo RL's is.
    @staticmethod
    def trainer_init(init_info: dict[str, Any] | Any) -> Group:
        """Open rank 0 of the group (``master_address``, ``master_port``,
        ``world_size``, optional ``timeout_s``) while the workers join it."""
        info = init_info if isinstance(init_info, dict) else vars(init_info)
        return open_group(
            info["master_address"],
            int(info["master_port"]),
            0,
            int(info["world_size"]),
            float(info.get("timeout_s", DEFAULT_TIMEOUT_S)),
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: dict[str, Any] | Any
    ) -> None:
        """Send one round to the workers' ``update_weights`` (running meanwhile),
        as ``NCCLWeightTransferEngine.trainer_send_weights`` does: ``group`` from
        ``trainer_init``; ``packed`` and its buffer options as in the update info."""
        args = trainer_args if isinstance(trainer_args, dict) else vars(trainer_args)
        post = args.get("post_iter_func")
        pairs = iterator if post is None else ((name, post((name, t))) for name, t in iterator)
        if args.get("src", SRC) != SRC:
            raise ValueError(f"gloo sends from rank {SRC}, not {args['src']}")
        send_packed(
            args["group"],
            pairs,
            buffer_bytes(
                bool(args.get("packed", False)),
                int(args.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)),
            ),
            int(args.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)),
        )


# -- the trainer's side ---------------------------------------------------------

# vLLM 0.32's trainer engines (0.23 has none: see the worker engine's static API).
if HAS_TRAINER_ENGINES:
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        VLLMWeightSyncClient,
        WeightSource,
    )
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    @dataclass
    class GlooTrainerInitInfo(NCCLTrainerInitInfo):
        """NCCL's trainer init info (``master_address``, ``master_port``,
        ``world_size``, keyword ``rank``, packing options) for ``gloo``, plus the
        rendezvous and per-broadcast ``timeout_s``."""

        backend: ClassVar[str] = BACKEND
        timeout_s: float = DEFAULT_TIMEOUT_S

    class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
        """vLLM's NCCL trainer engine (its ``send_weights`` round trip: start, the
        worker's update concurrently with the broadcast, finish) on a gloo group."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.timeout_s = timeout_s
            self.group: Group | None = None

        @classmethod
        def trainer_init(
            cls,
            init_info: GlooTrainerInitInfo,
            *,
            client: VLLMWeightSyncClient,
            source: WeightSource | None = None,
        ) -> GlooTrainerWeightTransferEngine:
            if source is None:
                raise ValueError("gloo trainer weight transfer requires a WeightSource")
            engine = cls(
                client=client,
                source=source,
                is_sender=init_info.is_sender,
                packed=init_info.packed,
                packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                packed_num_buffers=init_info.packed_num_buffers,
                timeout_s=init_info.timeout_s,
            )
            if not engine.is_sender:  # only joins the trainer-side gathers in send_weights
                return engine
            worker_info = GlooWeightTransferInitInfo(
                master_address=init_info.master_address,
                master_port=init_info.master_port,
                rank_offset=1,  # after the one sender, as NCCL's
                world_size=init_info.world_size,
                packed=init_info.packed,
                packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                packed_num_buffers=init_info.packed_num_buffers,
                timeout_s=init_info.timeout_s,
            )
            # The workers' init blocks in the rendezvous until rank 0 opens: ask them on
            # a side thread while this thread opens rank 0.
            with ThreadPoolExecutor(max_workers=1) as pool:
                joined = pool.submit(
                    client.init_weight_transfer_engine, worker_init_payload(worker_info)
                )
                engine.group = open_group(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    init_info.timeout_s,
                )
                joined.result()  # the inference side's error, if any
            return engine

        def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
            if not self.is_sender:
                super()._broadcast(source, meta)  # only the trainer-side gathers
                return
            if self.group is None:
                raise RuntimeError("trainer_init() must be called before send_weights()")
            send_packed(
                self.group,
                self._checked_iter(source, meta),
                buffer_bytes(self.packed, self.packed_buffer_size_bytes),
                self.packed_num_buffers,
            )

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.shutdown()
                self.group = None
