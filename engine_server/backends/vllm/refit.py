"""The refit half of the vLLM backend: what ``EngineBackend``'s refit seam does on a
vLLM ``AsyncLLM``.

Apart from the serving half (``backend.VllmBackend``, its subclass) because it
is its own job over the same engine: vLLM's pause,
weights from a path or a stream (``weights``), vLLM's weight-transfer engine
(its packing rule, ``transfer_packing``; the gloo engine's rollback and its
failures read back from text, ``engine_server.gloo.protocol``), the weights'
label where vLLM keeps none, and sleep.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Sequence
from typing import Any

import vllm
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.v1.engine.async_llm import AsyncLLM

from engine_server import vllm_compat as compat
from engine_server.backends import base
from engine_server.backends.base import EngineBackend
from engine_server.backends.refit import (
    PauseMode,
    RefitUnsupported,
    RlCapabilities,
    TensorSpec,
    WeightLoad,
    WeightWriter,
)
from engine_server.backends.vllm.transfer_packing import InitTimePacking
from engine_server.backends.vllm.weights import VllmWeights
from engine_server.errors import (
    EngineFailed,
    RefitTimedOut,
    TransferUnavailable,
    UpdateAbandoned,
)
from engine_server.gloo import protocol as gloo


class VllmRefit(EngineBackend):
    """The refit cycle on vLLM: its pause, ``reload_weights``, weight versions and
    transfer engines. Its subclass starts the engine and tells the router when the
    cache is gone."""

    def __init__(self, engine: AsyncLLM | None) -> None:
        # None until an owned engine started, and after shutdown (the subclass's
        # lifecycle sets it).
        self._engine = engine
        # Reads and loads checkpoints for this engine (set once the engine started).
        self._weights: VllmWeights | None = None
        # The packing the weight-transfer group's init set (transfer_packing).
        self._packing: InitTimePacking | None = None
        # The weights' label, where vLLM keeps none (0.23): set by set_weight_version.
        self._version = "default"

    @property
    def engine(self) -> AsyncLLM:
        if self._engine is None:
            raise base.EngineDeadError("the vLLM engine is not started")
        return self._engine

    @abstractmethod
    def _cleared(self) -> None:
        """Tell the router now that the engine's prefix cache is gone."""

    def rl_capabilities(self) -> RlCapabilities:
        engine = self._engine
        transfer = engine.vllm_config.weight_transfer_config if engine is not None else None
        return RlCapabilities(
            pause=True,
            update_from_path=True,
            update_from_tensors=True,
            weight_transfer_backend=str(transfer.backend) if transfer is not None else "",
            sleep=engine is not None and bool(engine.model_config.enable_sleep_mode),
        )

    def _weight_loader(self) -> VllmWeights:
        if self._weights is None:
            raise base.EngineDeadError("the vLLM engine is not started")
        return self._weights

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self.engine.pause_generation(mode=mode.value, clear_cache=clear_cache)
        if clear_cache:
            self._cleared()

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def load_weights_from_path(self, path: str, *, allow_partial: bool) -> WeightLoad:
        return await self._weight_loader().load_dir(path, allow_partial=allow_partial)

    async def begin_tensor_update(
        self, tensors: Sequence[TensorSpec], *, allow_partial: bool
    ) -> WeightWriter:
        return await self._weight_loader().writer(tensors, allow_partial=allow_partial)

    async def weight_names(self) -> Collection[str] | None:
        try:
            return (await self._weight_loader().schema()).keys()
        except RefitUnsupported:  # begin_tensor_update says why
            return None

    def _transfer_configured(self) -> None:
        if not self.rl_capabilities().weight_transfer_backend:
            raise self._unsupported(
                "a weight-transfer engine (start vLLM with --weight-transfer-config)"
            )

    def _transfer_packing(self) -> InitTimePacking:
        """The group's packing rule, for the engine class the workers created."""
        if self._packing is None:
            transfer = self.engine.vllm_config.weight_transfer_config
            self._packing = InitTimePacking.for_backend(str(transfer.backend))
        return self._packing

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self._transfer_configured()
        self._transfer_packing().note_init(init_info)
        try:
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info))
        except Exception as e:
            raise _transfer_error(e) from e

    async def start_weight_update(self) -> None:
        self._transfer_configured()
        await self.engine.start_weight_update()

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._transfer_configured()
        fitted = self._transfer_packing().fit_update(update_info)  # WeightUpdateError
        try:
            await self.engine.update_weights(WeightTransferUpdateRequest(fitted))
        except Exception as e:
            raise _transfer_error(e) from e

    async def abort_weight_update(self, reason: str) -> None:
        """Roll back the update in progress, as its trainer left it (gone between
        its calls): the gloo engine's abandoning round (``ABANDON_KEY``) puts the
        weights it found back and ends vLLM's update. Other engines cannot
        (RefitUnsupported); weights it could not put back raise EngineFailed."""
        self._transfer_configured()
        if self.rl_capabilities().weight_transfer_backend != gloo.BACKEND:
            raise self._unsupported("rolling back a weight-transfer update (the gloo engine can)")
        try:
            await self.engine.update_weights(
                WeightTransferUpdateRequest({gloo.ABANDON_KEY: reason})
            )
        except Exception as e:
            if isinstance(gloo.transfer_failure(e), gloo.UpdateRolledBack):
                return
            raise _transfer_error(e) from e

    async def finish_weight_update(self) -> WeightLoad:
        self._transfer_configured()
        await self.engine.finish_weight_update()
        return WeightLoad(0, 0)  # the transfer engine does not say

    async def shutdown_weight_transfer(self) -> None:
        self._transfer_configured()
        if not compat.has_transfer_shutdown(self.engine):
            raise self._unsupported(
                f"releasing the weight-transfer engine on vLLM {vllm.__version__} "
                "(no shutdown_weight_transfer_engine; the next init replaces it)"
            )
        await self.engine.shutdown_weight_transfer_engine()

    async def weight_version(self) -> str:
        if not compat.has_weight_versions(self.engine):
            return self._version
        return str(await self.engine.get_weight_version())

    async def set_weight_version(self, version: str) -> None:
        """vLLM's own label where it keeps one; else this backend's (the core
        stamps each rollout with the label serving it)."""
        if not compat.has_weight_versions(self.engine):
            self._version = version
            return
        await self.engine.update_weight_version(version)

    def check_sleep(self) -> None:
        if not self.rl_capabilities().sleep:
            raise self._unsupported(
                "sleep mode (start vLLM with --enable-sleep-mode; the CPU build has none)"
            )

    async def sleep(self, level: int, mode: PauseMode) -> None:
        self.check_sleep()
        await self.engine.sleep(level=level, mode=mode.value)
        self._cleared()

    async def wake_up(self, tags: Sequence[str]) -> bool:
        self.check_sleep()
        return compat.woke_fully(await self.engine.wake_up(list(tags) or None))


def _transfer_error(error: Exception) -> Exception:
    """A weight-transfer engine's failure as the engine server answers it: the gloo
    engine's kinds (``gloo.protocol.transfer_failure``, read from the text
    vLLM passes a worker's error on as) by what they mean; anything else as is."""
    failure = gloo.transfer_failure(error)
    if isinstance(failure, gloo.PeerSilent):
        return RefitTimedOut(f"{failure}; nothing was loaded, the old weights still serve")
    if isinstance(failure, gloo.PeerUnreachable | gloo.RendezvousStuck):
        return TransferUnavailable(f"{failure}; nothing was loaded, the old weights still serve")
    if isinstance(failure, gloo.UpdateRolledBack):
        return UpdateAbandoned(str(failure))
    if isinstance(failure, gloo.UpdateLeftPartWay):
        return EngineFailed(str(failure))
    return error
