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

Chunks are vLLM's (``packed_tensor.pack_tensors``): both sides
cut them by running ``pack_tensors`` over meta tensors (the worker's built from
the update info), so they agree by construction. Within a chunk, what travels is
cut finer (``runs``): a tensor of ``COALESCE_BYTES`` or more is broadcast alone,
straight from the trainer's memory (no packing copy) into a buffer of its own;
smaller neighbours share one packed broadcast. The worker hands tensors to the
model's ``load_weights`` every ``LOAD_BYTES`` (and at each chunk's end) while the
next runs arrive, so loading overlaps the transfer and a 1 GB chunk never needs
1 GB of buffers; ``packed_num_buffers`` x ``LOAD_BYTES`` are in flight (gloo
broadcasts are asynchronous). ``packed: false`` makes each tensor its own chunk.
As for NCCL, each tensor is a view of its received bytes, so a tensor packed
after others must start at a byte offset its element size divides (a model of
one dtype always does).

Init info keys (worker side; the trainer's ``GlooTrainerInitInfo`` takes NCCL's
``master_address``, ``master_port``, ``world_size``, keyword ``rank`` and packing
options, and sends the worker's): ``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``packed``, ``packed_buffer_size_bytes``,
``packed_num_buffers`` and ``timeout_s`` (default 30). ``timeout_s`` bounds the
rendezvous, so a trainer that never connects fails the worker's init instead of
hanging it (torch's TCP store retries once: expect the error within about twice
``timeout_s``), and each broadcast after it. Update info: NCCL's ``names``,
``dtype_names``, ``shapes``, and optionally the packing options per round
(``"packed": true``, as trainers written for older vLLM send them).

Registered under ``gloo`` in both of vLLM's factories by the engine server's vLLM
plugin (``engine_server.vllm_plugin.register_gloo_weight_transfer``), which vLLM
loads in every process; a trainer gets it from ``vllm.plugins.load_general_plugins()``.
Select it with ``--weight-transfer-config '{"backend": "gloo"}'``.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    PackedChunk,
    pack_tensors,
)

from engine_server.vllm_compat import (
    HAS_TRAINER_ENGINES,
    mtp_check_disabled,
    stateless_gloo_group,
)

BACKEND = "gloo"
DEFAULT_TIMEOUT_S = 30.0
SRC = 0  # the trainer's sender, as for NCCL

Group = Any  # torch.distributed.ProcessGroup (torch is not type-checked here)


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Group:
    """A gloo group outside torch.distributed's default one (the engine's worker has
    its own). Rank 0 hosts the TCP store; every other rank fails after about
    ``timeout_s`` (at most about twice that, with the store's retry) when rank 0
    never comes."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    return stateless_gloo_group(host, port, rank, world_size, timedelta(seconds=timeout_s))


def _wire_tensor(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    # Gloo sends host memory; a trainer's GPU tensors are copied out first.
    return item[1].detach().cpu()


def _as_is(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    return item[1]


def _cut(
    pairs: Iterator[tuple[str, torch.Tensor]],
    buffer_size_bytes: int | None,
    prepare: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
) -> Iterator[PackedChunk]:
    """``pack_tensors`` chunks; ``None``: one tensor per chunk (unpacked)."""

    def flat(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        # 1-d for vLLM 0.23's pack_tensors, which views the tensor as bytes first
        # (a 0-d float16 cannot be); the chunk keeps the original shape.
        return prepare(item).reshape(-1)

    if buffer_size_bytes is None:
        for pair in pairs:
            yield pack_tensors(iter([pair]), flat, sys.maxsize)
        return
    while (chunk := pack_tensors(pairs, flat, buffer_size_bytes)) is not None:
        yield chunk


def chunk_layout(
    metadata: Iterable[tuple[str, str, list[int]]], buffer_size_bytes: int | None
) -> Iterator[PackedChunk]:
    """The chunks ``send_packed`` cuts, from (name, dtype name, shape) alone:
    ``pack_tensors`` run over meta tensors (no memory), so the worker splits the
    stream exactly where the trainer does. Each chunk's ``packed_tensor`` is a meta
    tensor of the chunk's size."""
    placeholders = (
        (name, torch.empty(shape, dtype=getattr(torch, dtype_name), device="meta"))
        for name, dtype_name, shape in metadata
    )
    return _cut(placeholders, buffer_size_bytes, _as_is)


# Tensors smaller than this share a broadcast with their neighbours in the chunk
# (copied into one buffer, up to this size); larger ones travel alone, from and
# into their own memory.
COALESCE_BYTES = 1 << 20
# The worker hands received tensors to ``load`` once this many bytes are waiting
# (and at each chunk's end), so that loading overlaps the transfer.
LOAD_BYTES = 16 << 20


def runs(sizes: Sequence[int]) -> Iterator[range]:
    """A chunk's tensors (byte sizes, in order) as the runs that share one
    broadcast: consecutive tensors under ``COALESCE_BYTES``, up to that size
    together; each larger tensor alone."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        alone = size >= COALESCE_BYTES
        if i > start and (alone or total + size > COALESCE_BYTES):
            yield range(start, i)
            start, total = i, 0
        total += size
        if alone:
            yield range(i, i + 1)
            start, total = i + 1, 0
    if start < len(sizes):
        yield range(start, len(sizes))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _send_buffers(
    pairs: Iterator[tuple[str, torch.Tensor]], buffer_size_bytes: int | None
) -> Iterator[torch.Tensor]:
    """What the trainer broadcasts, in order: per chunk, per run, a tensor's own
    bytes (no copy) or a run's small tensors packed together."""
    held: list[torch.Tensor] = []

    def hold(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        tensor = _wire_tensor(item)
        held.append(tensor)
        return torch.empty_like(tensor, device="meta")  # pack_tensors then copies nothing

    for chunk in _cut(pairs, buffer_size_bytes, hold):
        tensors, held = held, []
        for run in runs(chunk.tensor_sizes):
            if len(run) == 1:
                yield _flat(tensors[run.start])
            else:
                yield torch.cat([_flat(tensors[i]) for i in run])


def _window(num_buffers: int) -> int:
    """Bytes in flight at most (at least one broadcast): ``num_buffers`` loads' worth."""
    return max(num_buffers, 1) * LOAD_BYTES


def send_packed(
    group: Group,
    pairs: Iterator[tuple[str, torch.Tensor]],
    buffer_size_bytes: int | None,
    num_buffers: int,
) -> int:
    """Broadcast ``pairs`` from rank 0, chunked as ``chunk_layout`` says and each
    chunk as ``runs`` says, ``num_buffers`` x ``LOAD_BYTES`` in flight; returns
    the bytes sent."""
    in_flight: deque[tuple[Any, torch.Tensor]] = deque()
    in_flight_bytes = sent = 0
    for buffer in _send_buffers(pairs, buffer_size_bytes):
        if not buffer.numel():
            continue
        while in_flight and in_flight_bytes + buffer.numel() > _window(num_buffers):
            work, done = in_flight.popleft()
            work.wait()
            in_flight_bytes -= done.numel()
        in_flight.append((group.broadcast(buffer, SRC), buffer))
        in_flight_bytes += buffer.numel()
        sent += buffer.numel()
    for work, _ in in_flight:
        work.wait()
    return sent


@dataclass
class _Arrival:
    """One run the worker is receiving: its buffer, its broadcast, its tensors."""

    chunk: PackedChunk
    run: range
    buffer: torch.Tensor
    work: Any  # None: nothing to receive (tensors of no bytes)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        c, r = self.chunk, slice(self.run.start, self.run.stop)
        parts = self.buffer.split(c.tensor_sizes[r])
        # Views of the buffer, as vLLM's unpack_tensor gives (whose 0.23 form
        # cannot shape a 0-d tensor).
        return [
            (name, part.view(dtype).view(shape))
            for name, shape, dtype, part in zip(
                c.names[r], c.shapes[r], c.dtypes[r], parts, strict=True
            )
        ]


def receive_packed(
    group: Group,
    layout: Iterable[PackedChunk],
    load: Callable[[list[tuple[str, torch.Tensor]]], Any],
    num_buffers: int,
) -> int:
    """Receive the chunks of ``layout`` (from ``chunk_layout``) run by run, as
    ``send_packed`` sends them, ``num_buffers`` x ``LOAD_BYTES`` posted ahead;
    hand the tensors to ``load`` each ``LOAD_BYTES`` and at each chunk's end,
    while the following runs arrive. Returns the bytes.

    Every run gets a fresh buffer: the tensors given to ``load`` are views of it,
    and vLLM's layerwise reload may keep them until the update finishes."""
    planned = (
        (chunk, run, sum(chunk.tensor_sizes[i] for i in run))
        for chunk in layout
        for run in runs(chunk.tensor_sizes)
    )
    following = next(planned, None)
    pending: deque[_Arrival] = deque()
    posted = 0  # bytes of the pending receives

    def post_ahead() -> None:
        nonlocal following, posted
        while following is not None and (
            not pending or posted + following[2] <= _window(num_buffers)
        ):
            chunk, run, nbytes = following
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            work = group.broadcast(buffer, SRC) if nbytes else None
            pending.append(_Arrival(chunk, run, buffer, work))
            posted += nbytes
            following = next(planned, None)

    post_ahead()
    received = ready_bytes = 0
    ready: list[tuple[str, torch.Tensor]] = []
    while pending:
        arrival = pending.popleft()
        if arrival.work is not None:
            arrival.work.wait()
        posted -= arrival.buffer.numel()
        post_ahead()  # before loading: the next runs travel meanwhile
        ready += arrival.tensors()
        ready_bytes += arrival.buffer.numel()
        chunk_done = arrival.run.stop == len(arrival.chunk.names)
        if chunk_done or ready_bytes >= LOAD_BYTES:
            load(ready)
            received += ready_bytes
            ready, ready_bytes = [], 0
    return received


def _buffer_bytes(packed: bool, packed_buffer_size_bytes: int) -> int | None:
    return packed_buffer_size_bytes if packed else None


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

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM 0.32's entry (0.23's worker calls ``receive_weights`` itself)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # loads went to the device
            torch.accelerator.synchronize()  # (the CPU build has none: it would raise)

    def receive_weights(
        self,
        update_info: GlooWeightTransferUpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ) -> None:
        """``load_weights``: the loader vLLM 0.23's worker hands in; 0.32 leaves it
        to the engine (the model's own)."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init first")
        load = self.model.load_weights if load_weights is None else load_weights

        def this_round(value: Any, default: Any) -> Any:
            return default if value is None else value

        packed = this_round(update_info.packed, self.packed)
        layout = chunk_layout(
            zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True),
            _buffer_bytes(
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
            _buffer_bytes(
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
                _buffer_bytes(self.packed, self.packed_buffer_size_bytes),
                self.packed_num_buffers,
            )

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.shutdown()
                self.group = None
