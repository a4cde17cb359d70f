"""Notes the etcd leases this bridge's records hold, for its supervisor to revoke
when the bridge dies without a word (``launch.leases``): the records then go at
once instead of a lease TTL later.

Only with etcd discovery, and only when a supervisor named the file
(``BRIDGE_LEASES_FILE``). Each lease is read from etcd itself, from a record the
bridge's runtimes wrote (the worker's instance, the ``rl`` carrier's), so the
note holds what etcd holds whatever a Dynamo version makes instance ids of.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from bridge.admin.instance_alias import EtcdAliasStore
from bridge.tasks import cancel_and_wait
from launch.leases import Leases, note_path, write
from rl_client import etcd_gateway

log = logging.getLogger(__name__)

# Polled until found, less often the longer it takes: a worker out of the router's
# pool from its start (its engine asleep) has no instance record until it rejoins.
POLL_S = 0.2
POLL_MAX_S = 5.0


class LeaseNote:
    """The leases noted so far, rewritten whole into the file as each is found."""

    def __init__(self, path: Path, endpoints: list[str]) -> None:
        self.path = path
        self.endpoints = endpoints
        self._store = EtcdAliasStore(endpoints)
        self.ids: list[int] = []
        self._finding: list[asyncio.Task[None]] = []

    @classmethod
    def from_env(
        cls, discovery_backend: str, environ: Mapping[str, str] = os.environ
    ) -> LeaseNote | None:
        """The note a supervisor asked for, with etcd discovery; else None."""
        path = note_path(environ)
        if discovery_backend != "etcd" or path is None:
            return None
        try:
            endpoints = etcd_gateway.clean_endpoints(etcd_gateway.env_endpoints(environ))
        except ValueError as e:  # Dynamo's runtime refuses it too, louder
            log.warning("etcd leases not noted for the supervisor: ETCD_ENDPOINTS: %s", e)
            return None
        return cls(path, endpoints)

    def follow(self, *keys: str) -> None:
        """Note the lease of the first of ``keys`` whose record a runtime has
        written (records under one lease: whichever is there)."""
        self._finding.append(asyncio.get_running_loop().create_task(self._find(keys)))

    async def _find(self, keys: tuple[str, ...]) -> None:
        pause, error = POLL_S, ""
        while True:
            for key in keys:
                try:
                    found = await self._store.find(key)
                except (ConnectionError, ValueError) as e:
                    if str(e) != error:  # said once, not at every poll
                        log.warning("the etcd lease of %s not read (%s): trying again", key, e)
                    error, found = str(e), None
                if found is not None:
                    _, lease = found  # the record and its lease (none: "0" or absent)
                    if lease and int(lease):
                        self._add(int(lease))
                    return
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    def _add(self, lease: int) -> None:
        if lease in self.ids:
            return
        self.ids.append(lease)
        try:
            write(self.path, Leases(tuple(self.endpoints), tuple(self.ids)))
        except OSError as e:
            log.warning("etcd lease %x not noted in %s (%s)", lease, self.path, e)

    async def stop(self) -> None:
        finding, self._finding = self._finding, []
        for task in finding:
            await cancel_and_wait(task)
