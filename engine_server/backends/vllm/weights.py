"""Weight updates for a vLLM engine: checked against the served checkpoint, then
loaded with vLLM's in-place ``reload_weights``.

Why this route: tensors passed through ``collective_rpc`` do not arrive (msgpack
drops their out-of-band buffers), while ``reload_weights(weights_path=DIR)``
loads any safetensors directory in place, layer by layer, and gives outputs
identical to a fresh engine on that checkpoint. Streamed tensors are therefore
written as a checkpoint into a private tmpfs directory and loaded the same way
(about 360 MB/s on two cores). Why the check first: vLLM given a tensor of the
wrong shape or an unknown name leaves its layers half-loaded and dies at its
next step; checked against the served checkpoint's safetensors headers, such
an update is refused and the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from vllm.v1.engine.async_llm import AsyncLLM

from engine_server.backends.checkpoint import (
    SafetensorsWriter,
    check_update,
    checkpoint_schema,
)
from engine_server.backends.refit import (
    OffLoop,
    RefitUnsupported,
    TensorSpec,
    WeightLoad,
    WeightUpdateError,
    WeightWriter,
)

log = logging.getLogger(__name__)


class VllmWeights:
    def __init__(self, engine: AsyncLLM, model_path: str) -> None:
        self._engine = engine
        self._model_path = model_path
        self._schema: dict[str, TensorSpec] | None = None

    async def schema(self) -> dict[str, TensorSpec]:
        """The served checkpoint's tensors (read once, from the headers, off the loop).
        RefitUnsupported (FAILED_PRECONDITION) when it cannot be read: no update
        could be checked, so none is loaded."""
        if self._schema is None:
            self._schema = await asyncio.to_thread(self._read_schema)
        return self._schema

    def _read_schema(self) -> dict[str, TensorSpec]:
        if not Path(self._model_path).is_dir():
            raise RefitUnsupported(
                f"weight updates: the served model {self._model_path!r} is not a local "
                "directory, so updates cannot be checked against its tensors"
            )
        try:
            return checkpoint_schema(self._model_path)
        except WeightUpdateError as e:
            raise RefitUnsupported(
                f"weight updates: the served model's checkpoint cannot be read ({e}), so "
                "updates cannot be checked against it"
            ) from e

    async def load_dir(self, path: str, *, allow_partial: bool) -> WeightLoad:
        # Absolute: vLLM treats a path it cannot find as a model hub id.
        path = await asyncio.to_thread(os.path.abspath, path)
        update = await asyncio.to_thread(checkpoint_schema, path)
        check_update(await self.schema(), list(update.values()), allow_partial=allow_partial)
        await self._reload(path)
        return WeightLoad(len(update), sum(spec.nbytes for spec in update.values()))

    async def writer(self, specs: Sequence[TensorSpec], *, allow_partial: bool) -> WeightWriter:
        check_update(await self.schema(), specs, allow_partial=allow_partial)
        return _StagedWriter(self, specs)

    async def _reload(self, absolute_path: str) -> None:
        await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": absolute_path})


class _StagedWriter(WeightWriter):
    """Stages the streamed bytes as a safetensors checkpoint, then reloads it."""

    def __init__(self, weights: VllmWeights, specs: Sequence[TensorSpec]) -> None:
        self._weights = weights
        self._specs = list(specs)
        self._file = SafetensorsWriter(specs)
        self._worker = OffLoop(self._file.write)

    async def write(self, data: memoryview) -> None:
        await self._worker.submit(data)

    async def commit(self) -> WeightLoad:
        staged = self._file
        await self._worker.close()
        if staged.written != staged.total:
            raise WeightUpdateError(f"got {staged.written} of {staged.total} bytes")
        staged.close()
        try:
            await self._weights._reload(str(staged.directory))
        finally:
            staged.remove()
        return WeightLoad(len(self._specs), staged.total)

    async def discard(self) -> None:
        try:
            await self._worker.close()
        finally:
            self._file.remove()
