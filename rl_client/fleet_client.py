"""What both of the trainer's refit clients (``rl_client.refit``) offer besides
the cycle (``rl_client.fleet_cycle``), alike whatever carries their calls: the
workers found through Dynamo's discovery (``from_discovery``), ``async with``
closing the client's connections, and resuming workers by hand. No Dynamo import
here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from rl_client.committed import CommittedStore, CommittedWeights
from rl_client.fleet_cycle import FleetCycle
from rl_client.fleet_discovery import FleetDiscovery, FleetWorker, discover_workers
from rl_client.refit_report import Deadlines

__all__ = ["FleetClient"]


def _discovered(
    namespace: str,
    component: str,
    model: str | None,
    discovery: FleetDiscovery | None,
    field_name: str,
) -> list[FleetWorker]:
    """The live workers found in discovery; ValueError when there are none, or one
    has no ``field_name`` (a bridge serving no admin routes, say)."""
    workers = discover_workers(namespace, component, model=model, discovery=discovery)
    serving = f" serving {model!r}" if model is not None else ""
    if not workers:
        raise ValueError(
            f"no live worker of {namespace}/{component}{serving} in discovery (none "
            "registered, or none of them a bridge that publishes its RL record)"
        )
    lacking = [w for w in workers if getattr(w, field_name) is None]
    if lacking:
        raise ValueError(
            f"{len(lacking)} of the {len(workers)} workers of {namespace}/{component}{serving} "
            f"published no {field_name} (instances {[hex(w.instance_id) for w in lacking]})"
        )
    return workers


class FleetClient(FleetCycle):
    """What both clients offer besides the cycle, alike whatever carries their
    calls: the workers discovery listed, ``async with`` closing the client's
    connections, and resuming workers by hand."""

    # The workers as discovery listed them (``from_discovery``), else empty.
    discovered: list[FleetWorker]
    # The FleetWorker field holding the address this client calls a worker at.
    address_field: ClassVar[str]

    def __init__(
        self,
        workers: Sequence[str],
        what: str,
        committed: CommittedWeights | None,
        store: CommittedStore | None,
        deadlines: Deadlines | None,
    ) -> None:
        """``workers``: the addresses called (``what`` names them), never none."""
        if not workers:
            raise ValueError(f"no {what}")
        super().__init__(committed, store, deadlines)
        self.discovered = []

    @classmethod
    def from_discovery(
        cls,
        namespace: str,
        component: str = "backend",
        *,
        model: str | None = None,
        discovery: FleetDiscovery | None = None,
        **options: Any,
    ) -> Self:
        """A client for the workers of ``namespace``/``component`` (serving ``model``,
        when given) that are registered now, their addresses (``address_field``)
        read from Dynamo's discovery (``rl_client.fleet_discovery``; ``discovery``:
        the environment's by default). ``options``: the constructor's. A blocking
        read: call it again for each step to follow the fleet. ValueError when no
        worker is found, or one publishes no such address."""
        workers = _discovered(namespace, component, model, discovery, cls.address_field)
        client = cls._for_workers(workers, **options)
        client.discovered = workers
        return client

    @classmethod
    @abstractmethod
    def _for_workers(cls, workers: list[FleetWorker], **options: Any) -> Self:
        """A client for ``workers`` (each with an ``address_field``); ``options``:
        the constructor's."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    async def close(self) -> None:
        """Close this client's connections to the workers."""

    async def resume(self, workers: Sequence[str] | None = None) -> None:
        """Resume ``workers`` (default: the whole fleet), as after a refit."""
        await asyncio.gather(*(self._resume(w) for w in workers or self._fleet()))
