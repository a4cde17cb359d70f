"""The refit RPCs' requests decoded, before the refit rules see them: a JSON body as
the object it holds, a streamed update as its manifest's tensors and their bytes.

Here, beside the servicer, because decoding is the transport's part: the stream's
idle watchdog, messages that are not valid (``handlers.Undecodable``), chunks out of
order and reading the rest of a refused stream (a gRPC client answered early
reports INTERNAL) are what a gRPC stream needs; ``RefitControl`` takes decoded
values (through ``weight_updates``) and holds only the rules.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any

from engine_contract.tensors import TENSOR_DTYPE_NAMES
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from engine_server.admission import check_length
from engine_server.backends.refit import TensorSpec, WeightUpdateError
from engine_server.errors import InvalidRequest, ServerError, UpdateStalled
from engine_server.handlers import Undecodable

if TYPE_CHECKING:
    from engine_server.core import ServerCore

# The longest tensor name a manifest may carry (a checkpoint's names are short).
MAX_TENSOR_NAME_LENGTH = 1024
# How long the end of a tensor stream with no end marker (a client of revision 12)
# waits before its weights are committed. gRPC's asyncio server ends the request
# stream alike when the client half-closes it and when the client dies (killed
# after its last chunk, before closing): only the handler's cancellation, a moment
# later, tells the death apart. Measured: 0.1 ms after the end on an idle machine;
# nothing is committed before this has passed. A stream whose manifest announced
# its `end` (revision 13) needs no wait: the marker says the client finished.
END_SETTLE_S = 0.1

_Message = pb.UpdateWeightsFromTensorsRequest | Undecodable


def json_object(field: str, raw: bytes, *, arrays: bool = False) -> Any:
    """A JSON object (or, with ``arrays``, an array of them: vLLM's update
    payload may batch several)."""
    try:
        value = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(field, f"must contain valid JSON: {e}") from e
    ok = isinstance(value, dict) or (
        arrays and isinstance(value, list) and all(isinstance(v, dict) for v in value)
    )
    if not ok:
        raise InvalidRequest(
            field, "must contain a JSON object" + (" or an array of them" if arrays else "")
        )
    return value


async def update_from_tensors(
    core: ServerCore, requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest]
) -> pb.UpdateWeightsFromTensorsResponse:
    """An ``UpdateWeightsFromTensors`` call: its manifest checked, then its chunks
    handed to ``core.updates`` as they come. A refused call's remaining messages
    are read before it answers: ending a client-streaming call while the client
    still sends makes gRPC clients report INTERNAL ("Internal error from Core")
    instead of the refusal."""
    messages = _paced(requests, core.config.stream_write_timeout_s)
    try:
        first = await anext(messages, None)
        if isinstance(first, Undecodable):
            raise InvalidRequest("UpdateWeightsFromTensorsRequest", str(first))
        if first is None or first.WhichOneof("part") != "manifest":
            raise InvalidRequest("manifest", "the first message must be the tensor manifest")
        manifest = first.manifest
        _no_longer_than_the_model(manifest, await core.backend.weight_names())
        specs = _specs(manifest)
        chunks = _Chunks(messages, specs, marked=manifest.ends_with_marker)
        return await core.updates.update_from_tensors(manifest.options, specs, chunks)
    except (ServerError, WeightUpdateError):
        async for _ in messages:
            pass
        raise


async def _paced(
    requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest], idle_timeout_s: float | None
) -> AsyncIterator[_Message]:
    """The request stream, ended with ABORTED when the client goes silent: a trainer
    that stalls must not hold the refit lock for good."""
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UpdateStalled(
                f"the weight update's next message did not come within {idle_timeout_s:g} s; "
                "nothing was loaded, the old weights still serve"
            ) from None
        yield message


def _no_longer_than_the_model(manifest: pb.TensorManifest, names: Collection[str] | None) -> None:
    """Refuse a manifest naming more tensors than the model has, before its specs
    are built (100,000 of them cost some 35 MB), naming the first that is not the
    model's (there is one, or a name repeats)."""
    if names is None or len(manifest.tensors) <= len(names):
        return
    unknown = next((t.name for t in manifest.tensors if t.name not in names), None)
    what = f"tensor {clip(unknown)} is not a weight of this model" if unknown else "names repeat"
    raise InvalidRequest(
        "manifest.tensors",
        f"{len(manifest.tensors)} tensors, more than the served model's {len(names)} "
        f"({what}); the old weights still serve",
    )


def _specs(manifest: pb.TensorManifest) -> list[TensorSpec]:
    if not manifest.tensors:
        raise InvalidRequest("manifest.tensors", "no tensors")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for i, tensor in enumerate(manifest.tensors):
        field = f"manifest.tensors[{i}]"
        if not tensor.name or tensor.name in seen:
            raise InvalidRequest(f"{field}.name", "empty or repeated")
        check_length(f"{field}.name", tensor.name, MAX_TENSOR_NAME_LENGTH)
        seen.add(tensor.name)
        dtype = TENSOR_DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise InvalidRequest(f"{field}.dtype", f"unknown TensorDtype value {tensor.dtype}")
        if any(d < 0 for d in tensor.shape):
            raise InvalidRequest(f"{field}.shape", f"negative dimension in {list(tensor.shape)}")
        specs.append(TensorSpec(tensor.name, dtype, tuple(tensor.shape)))
    return specs


class _Chunks:
    """The chunks after the manifest, checked to come whole and in order: their bytes,
    one chunk at a time, as the refit control reads them. ``marked``: the manifest
    announced an ``end`` message, without which the stream loads nothing."""

    def __init__(
        self, messages: AsyncIterator[_Message], specs: list[TensorSpec], *, marked: bool
    ) -> None:
        self._messages = messages
        self._specs = specs
        self._marked = marked
        self._sizes = [spec.nbytes for spec in specs]
        self._index = 0  # the tensor the next byte belongs to
        self._received = 0  # its bytes so far
        self._past_whole_tensors()

    def _past_whole_tensors(self) -> None:
        while self._index < len(self._specs) and self._received == self._sizes[self._index]:
            self._index, self._received = self._index + 1, 0

    def __aiter__(self) -> _Chunks:
        return self

    def _check_whole(self, at: str) -> None:
        index, specs = self._index, self._specs
        if index < len(specs):
            raise InvalidRequest(
                "chunk",
                f"the stream {at} short: tensor {specs[index].name!r} got {self._received} "
                f"of {self._sizes[index]} bytes ({len(specs) - index} tensors incomplete); "
                "nothing was loaded",
            )

    async def __anext__(self) -> memoryview:
        index, received, specs, sizes = self._index, self._received, self._specs, self._sizes
        message = await anext(self._messages, None)
        if message is None:
            self._check_whole("ended")
            if self._marked:
                raise InvalidRequest(
                    "end",
                    "the stream ended without the end message its manifest announced "
                    "(ends_with_marker): the client died or stopped before it; nothing "
                    "was loaded",
                )
            # A client that died here is cancelled now: nothing of its is committed.
            await asyncio.sleep(END_SETTLE_S)
            raise StopAsyncIteration
        if isinstance(message, Undecodable):
            raise InvalidRequest("UpdateWeightsFromTensorsRequest", str(message))
        part = message.WhichOneof("part")
        if part == "end":
            self._check_whole("came to its end message")
            # Then the half-close (a live client's, at once): answering before it
            # would make the client's gRPC report INTERNAL instead of the answer.
            if await anext(self._messages, None) is not None:
                raise InvalidRequest("end", "a message came after the end message")
            raise StopAsyncIteration
        if part != "chunk":
            raise InvalidRequest("manifest", "only the first message is a manifest")
        chunk = message.chunk
        if index >= len(specs):
            raise InvalidRequest("chunk", "more bytes than the manifest's tensors hold")
        if chunk.tensor != index or chunk.offset != received:
            raise InvalidRequest(
                "chunk",
                f"out of order: expected tensor {index} ({specs[index].name!r}) at byte "
                f"{received}, got tensor {chunk.tensor} at byte {chunk.offset}",
            )
        data = memoryview(chunk.data)
        if received + len(data) > sizes[index]:
            raise InvalidRequest(
                "chunk", f"tensor {specs[index].name!r} is {sizes[index]} bytes; more were sent"
            )
        self._received += len(data)
        self._past_whole_tensors()
        return data
