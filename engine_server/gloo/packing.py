"""How an update's tensors travel over the gloo group: cut into vLLM's chunks, and
within a chunk into broadcasts, sent and received a window ahead.

Chunks are vLLM's (``packed_tensor.pack_tensors``' rule: tensors in order until
their bytes pass the buffer size, the one that passes included). Both sides cut
them from names, shapes and dtypes alone (``_cut``; the worker's from the update
info), so they agree by construction; a test holds the rule to vLLM's function.
Within a chunk, what travels is cut finer (``runs``): a tensor of
``COALESCE_BYTES`` or more is broadcast alone, straight from the trainer's memory
(no packing copy) into a buffer of its own; smaller neighbours share one packed
broadcast. The worker hands tensors to the model's ``load_weights`` every
``LOAD_BYTES`` (and at each chunk's end) while the next runs arrive, so loading
overlaps the transfer and a 1 GB chunk never needs 1 GB of buffers;
``packed_num_buffers`` x ``LOAD_BYTES`` are in flight (gloo broadcasts are
asynchronous). ``packed: false`` makes each tensor its own chunk. As for NCCL,
each tensor is a view of its received bytes, so a tensor packed after others must
start at a byte offset its element size divides (a model of one dtype always does).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from engine_server.gloo.rendezvous import Group

SRC = 0  # the trainer's sender, as for NCCL

T = TypeVar("T")


@dataclass
class Chunk(Generic[T]):
    """One chunk as vLLM's ``PackedChunk`` describes it (names, shapes, dtypes,
    byte sizes), with what each side holds per tensor (``items``)."""

    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    tensor_sizes: list[int] = field(default_factory=list)
    items: list[T] = field(default_factory=list)


def _cut(
    entries: Iterable[tuple[str, Sequence[int], torch.dtype, T]],
    buffer_size_bytes: int | None,
) -> Iterator[Chunk[T]]:
    """The chunks of (name, shape, dtype, item) ``entries``, lazily, by
    ``pack_tensors``' rule; ``None``: one tensor per chunk (unpacked).

    Sizes alone, not ``pack_tensors`` over meta tensors: its ``torch.cat`` of meta
    tensors runs a Python decomposition under ``torch._dynamo.disable``, which is
    not thread safe (pytorch#118260); three threads of one process cutting at once
    (a trainer and two workers) crashed torch 2.11 once."""
    limit = -1 if buffer_size_bytes is None else buffer_size_bytes
    chunk: Chunk[T] = Chunk()
    total = 0
    for name, shape, dtype, item in entries:
        size = math.prod(shape) * dtype.itemsize
        chunk.names.append(name)
        chunk.shapes.append(list(shape))
        chunk.dtypes.append(dtype)
        chunk.tensor_sizes.append(size)
        chunk.items.append(item)
        total += size
        if total > limit:
            yield chunk
            chunk, total = Chunk(), 0
    if chunk.names:
        yield chunk


def chunk_layout(
    metadata: Iterable[tuple[str, str, list[int]]], buffer_size_bytes: int | None
) -> Iterator[Chunk[None]]:
    """The chunks ``send_packed`` cuts, from (name, dtype name, shape) alone, so
    the worker splits the stream exactly where the trainer does."""
    return _cut(
        (
            (name, _shape(name, shape), _dtype(name, dtype_name), None)
            for name, dtype_name, shape in metadata
        ),
        buffer_size_bytes,
    )


def _dtype(name: str, dtype_name: str) -> torch.dtype:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}: dtype {dtype_name!r} is not a torch dtype")
    return dtype


def _shape(name: str, shape: Sequence[int]) -> Sequence[int]:
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"{name}: shape {list(shape)} is not a list of sizes")
    return shape


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
    bytes (no copy) or a run's small tensors packed together. Gloo sends host
    memory: a trainer's GPU tensors are copied out, one chunk at a time."""
    entries = ((name, t.shape, t.dtype, t) for name, t in pairs)
    for chunk in _cut(entries, buffer_size_bytes):
        tensors = [t.detach().cpu() for t in chunk.items]
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

    chunk: Chunk[None]
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
    layout: Iterable[Chunk[None]],
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


def buffer_bytes(packed: bool, packed_buffer_size_bytes: int) -> int | None:
    return packed_buffer_size_bytes if packed else None
