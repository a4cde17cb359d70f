"""The caller's deadline on InitWeightTransferEngine (contract revision 7's
``timeout_ms``): the RL route's ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S`` reaches the
engine server, which gives up there (never past its own refit deadline), shuts
the transfer engine down, answers DEADLINE_EXCEEDED naming that deadline, and
keeps serving; a gloo init info without its own ``timeout_s`` gets this one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from engine_server.backends.refit import RlCapabilities
from engine_server.config import RefitConfig
from engine_server.core import ServerCore
from engine_server.errors import RefitTimedOut
from tests.unit.test_refit_control import sim_core

pytestmark = pytest.mark.serial


def hanging_transfer(core: ServerCore, transfer_backend: str) -> tuple[list[Any], list[bool]]:
    """The backend's init hangs (a trainer that never connects); returns (the init
    infos it was given, one entry per shutdown)."""
    backend = core.backend
    infos: list[Any] = []
    shut_down: list[bool] = []

    async def hang(info: Any) -> None:
        infos.append(info)
        await asyncio.sleep(30)

    async def shutdown() -> None:
        shut_down.append(True)

    capabilities = backend.rl_capabilities()
    backend.rl_capabilities = lambda: RlCapabilities(  # type: ignore[method-assign]
        pause=capabilities.pause,
        update_from_path=capabilities.update_from_path,
        update_from_tensors=capabilities.update_from_tensors,
        weight_transfer_backend=transfer_backend,
        sleep=capabilities.sleep,
    )
    backend.init_weight_transfer = hang  # type: ignore[method-assign]
    backend.shutdown_weight_transfer = shutdown  # type: ignore[method-assign]
    return infos, shut_down


async def test_the_callers_deadline_shuts_down_and_names_itself() -> None:
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=60)) as core:
        infos, shut_down = hanging_transfer(core, "gloo")
        started = time.monotonic()
        with pytest.raises(RefitTimedOut) as late:
            await core.updates.init_weight_transfer({"master_port": 1}, 0.2)
        assert time.monotonic() - started < 2
        message = str(late.value)
        assert "the caller's init deadline of 0.2 s (timeout_ms)" in message
        assert "shut down" in message and "old weights still serve" in message
        assert shut_down == [True] and core.refit.broken is None
        # gloo: the rendezvous gets the same bound, so the engine stops waiting too.
        assert infos == [{"master_port": 1, "timeout_s": 0.2}]


async def test_a_gloo_info_keeps_its_own_timeout_and_other_backends_get_none() -> None:
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=60)) as core:
        infos, _ = hanging_transfer(core, "gloo")
        with pytest.raises(RefitTimedOut):
            await core.updates.init_weight_transfer({"timeout_s": 5}, 0.1)
        assert infos == [{"timeout_s": 5}]
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=60)) as core:
        infos, _ = hanging_transfer(core, "nccl")
        with pytest.raises(RefitTimedOut):
            await core.updates.init_weight_transfer({}, 0.1)
        assert infos == [{}]  # NCCL's init info takes no timeout_s


async def test_never_past_the_servers_refit_deadline() -> None:
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=0.2)) as core:
        infos, shut_down = hanging_transfer(core, "gloo")
        with pytest.raises(RefitTimedOut, match=r"refit deadline of 0\.2 s \(--refit-timeout-s\)"):
            await core.updates.init_weight_transfer({}, 30)
        assert infos == [{}] and shut_down == [True]
