"""Fakes for the rl_client tests: a fleet cycle over scripted workers, no gRPC,
for what the cycle decides rather than what a transport carries."""

from __future__ import annotations

from rl_client.committed import WeightSource
from rl_client.fleet_cycle import FleetCycle, RollbackTarget
from rl_client.refit_report import Served, WorkerHealth


class Obedient(FleetCycle):
    """Two workers, ``w0`` and ``w1``, that do as they are told and serve; a test
    overrides the steps it scripts. Made with ``committed=`` (or a store holding
    the record): the start state is never asked for."""

    def _fleet(self) -> list[str]:
        return ["w0", "w1"]

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        pass

    async def _resume(self, worker: str) -> None:
        pass

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        return None

    async def _label(self, worker: str, version: str, expect: int | None) -> int | None:
        return None

    async def _serving(self, worker: str) -> Served:
        return Served("?")

    async def _health(self, worker: str) -> WorkerHealth:
        return WorkerHealth.SERVING

    async def _sleep(self, worker: str) -> None:
        pass

    def _loads(self, source: WeightSource) -> bool:
        return True

    async def _start_state(self) -> dict[str, RollbackTarget]:
        raise AssertionError("committed= was given")
