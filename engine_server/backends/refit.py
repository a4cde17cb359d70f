"""The refit seam: what a backend does for the RL refit cycle, in engine-neutral terms.

The core owns the cycle's rules (serialization, "paused before update", the
version, requests waiting while paused, what an aborted rollout answers); a
backend only acts on its engine. ``EngineBackend`` implements every method as
"not supported" (``RefitUnsupported``, FAILED_PRECONDITION naming why), and
says what it does support in ``rl_capabilities()``.
"""

from __future__ import annotations

import asyncio
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine_contract.tensors import TENSOR_DTYPE_BYTES

# Bytes per element, by the names the contract's TensorDtype maps to.
DTYPE_BYTES = TENSOR_DTYPE_BYTES


class PauseMode(enum.Enum):
    ABORT = "abort"  # requests in flight end now
    WAIT = "wait"  # the pause returns once they have finished
    KEEP = "keep"  # they freeze, and continue on resume


@dataclass(frozen=True)
class RlCapabilities:
    pause: bool = False
    update_from_path: bool = False
    update_from_tensors: bool = False
    weight_transfer_backend: str = ""
    sleep: bool = False


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a weight update: its name in the checkpoint, dtype, shape."""

    name: str
    dtype: str  # a DTYPE_BYTES key
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class WeightLoad:
    """What an update loaded."""

    tensors: int
    bytes: int


class RefitUnsupported(RuntimeError):
    """This engine cannot do that (FAILED_PRECONDITION, with the reason)."""


class WeightUpdateError(ValueError):
    """The update cannot be applied (missing path, names or shapes that do not
    fit the model); nothing was loaded: the old weights still serve."""


class WeightWriter(ABC):
    """Receives a streamed update: the manifest's tensors' bytes, in order."""

    @abstractmethod
    async def write(self, data: memoryview) -> None:
        """The next bytes (they continue exactly where the previous ones ended)."""

    @abstractmethod
    async def commit(self) -> WeightLoad:
        """Every byte arrived: load the weights (raise WeightUpdateError to refuse)."""

    @abstractmethod
    async def discard(self) -> None:
        """The update is abandoned: free what was received; the old weights stay."""


class OffLoop:
    """A writer's blocking work (digests, file writes) on a thread of its own, a
    batch behind: chunks gather until ``batch_bytes``, then go to the thread
    together while the next ones arrive, so the event loop hands over rarely and
    keeps answering (health, GetLoad) during a large update."""

    def __init__(self, work: Callable[[memoryview], None], batch_bytes: int = 8 << 20) -> None:
        self._work = work
        self._batch_bytes = batch_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._pending: asyncio.Future[None] | None = None
        self._batch: list[memoryview] = []
        self._batched = 0

    async def submit(self, data: memoryview) -> None:
        self._batch.append(data)
        self._batched += len(data)
        if self._batched >= self._batch_bytes:
            await self._hand_over()

    async def _hand_over(self) -> None:
        await self._wait()
        batch, self._batch, self._batched = self._batch, [], 0
        if batch:
            loop = asyncio.get_running_loop()
            self._pending = loop.run_in_executor(self._pool, self._run, batch)

    def _run(self, batch: list[memoryview]) -> None:
        for data in batch:
            self._work(data)

    async def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    async def drain(self) -> None:
        """Finish everything submitted so far (raising what the work raised)."""
        await self._hand_over()
        await self._wait()

    async def close(self) -> None:
        try:
            await self.drain()
        finally:
            self._pool.shutdown(wait=False)
