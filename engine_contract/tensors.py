"""Tensors over the contract: dtype names, and weight updates as a request stream.

Shared by both sides and by trainers: ``update_requests`` turns named tensors
(any buffer: ``bytes``, a NumPy array, a torch tensor viewed as bytes) into the
``UpdateWeightsFromTensors`` stream: the manifest first, then each tensor's
bytes in order, in chunks under the server's message limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from engine_contract.dtypes import TENSOR_DTYPE_BYTES as TENSOR_DTYPE_BYTES
from engine_contract.v1 import engine_pb2 as pb

# Our dtype names (NumPy's and torch's spelling) -> the contract's TensorDtype.
TENSOR_DTYPES = {
    "uint8": pb.TENSOR_DTYPE_UINT8,
    "int8": pb.TENSOR_DTYPE_INT8,
    "uint16": pb.TENSOR_DTYPE_UINT16,
    "int16": pb.TENSOR_DTYPE_INT16,
    "int32": pb.TENSOR_DTYPE_INT32,
    "int64": pb.TENSOR_DTYPE_INT64,
    "float16": pb.TENSOR_DTYPE_FLOAT16,
    "bfloat16": pb.TENSOR_DTYPE_BFLOAT16,
    "float32": pb.TENSOR_DTYPE_FLOAT32,
    "float64": pb.TENSOR_DTYPE_FLOAT64,
    "bool": pb.TENSOR_DTYPE_BOOL,
    "float8_e4m3fn": pb.TENSOR_DTYPE_FLOAT8_E4M3FN,
    "float8_e5m2": pb.TENSOR_DTYPE_FLOAT8_E5M2,
}
TENSOR_DTYPE_NAMES = {number: name for name, number in TENSOR_DTYPES.items()}

# Well under every server's message limit (the default is 64 MiB), and where
# protobuf serializes fast (about 3 GB/s at 1 MiB on two cores; a few hundred
# MB/s at 16 MiB, where every message is a fresh large allocation).
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Tensor:
    """One tensor of an update: checkpoint name, dtype name, shape, and its bytes
    (row-major, little-endian; anything exposing the buffer protocol)."""

    name: str
    dtype: str
    shape: Sequence[int]
    data: object

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes  # type: ignore[arg-type]


def update_requests(
    tensors: Iterable[Tensor],
    *,
    weight_version: str | None = None,
    reset_prefix_cache: bool | None = None,
    allow_unpaused: bool = False,
    allow_partial: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    expect_weight_changes: int | None = None,
    end_marker: bool = False,
) -> Iterator[pb.UpdateWeightsFromTensorsRequest]:
    """The request stream for ``UpdateWeightsFromTensors`` (``expect_weight_changes``:
    the fence, contract revision 10). ``end_marker``: announce and send the stream's
    ``end`` message (revision 13: only to servers of ``TENSOR_STREAM_END_REVISION`` or
    later), so that the server commits at once and loads nothing should this client
    die before it."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    items = list(tensors)
    manifest = pb.TensorManifest()
    for tensor in items:
        if tensor.dtype not in TENSOR_DTYPES:
            raise ValueError(f"tensor {tensor.name!r}: unknown dtype {tensor.dtype!r}")
        manifest.tensors.add(
            name=tensor.name, dtype=TENSOR_DTYPES[tensor.dtype], shape=list(tensor.shape)
        )
    options = manifest.options
    if weight_version is not None:
        options.weight_version = weight_version
    if reset_prefix_cache is not None:
        options.reset_prefix_cache = reset_prefix_cache
    if expect_weight_changes is not None:
        options.expect_weight_changes = expect_weight_changes
    options.allow_unpaused = allow_unpaused
    options.allow_partial = allow_partial
    manifest.ends_with_marker = end_marker
    yield pb.UpdateWeightsFromTensorsRequest(manifest=manifest)
    for index, tensor in enumerate(items):
        view = memoryview(tensor.data).cast("B")  # type: ignore[arg-type]
        for offset in range(0, len(view), chunk_bytes):
            # Fields set in place: building the chunk apart and nesting it would copy
            # its bytes once more.
            request = pb.UpdateWeightsFromTensorsRequest()
            request.chunk.tensor = index
            request.chunk.offset = offset
            request.chunk.data = bytes(view[offset : offset + chunk_bytes])
            yield request
    if end_marker:
        yield pb.UpdateWeightsFromTensorsRequest(end=pb.TensorStreamEnd())
