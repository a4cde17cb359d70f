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

from bridge.tasks import cancel_and_wait
from launch.leases import Leases, note_path, write
from rl_client import etcd_gateway

log = logging.getLogger(__name__)

# Polled until found, less often the longer it takes: a worker out of the router's
# pool from its start (its engine asleep) has no instance record until it rejoins.
POLL_S = 0.2
POLL_MAX_S = 5.0
ETCD_TIMEOUT_S = 2.0


def lease_of(endpoints: list[str], key: str) -> int | None:
    """The lease ``key``'s record is held by (blocking); None while there is no
    record, 0 for a record held by none."""
    answer = etcd_gateway.call(
        endpoints, "kv/range", {"key": etcd_gateway.b64(key.encode())}, ETCD_TIMEOUT_S
    )
    kvs = answer.get("kvs") or []
    return int(kvs[0].get("lease") or 0) if kvs else None


class LeaseNote:
    """The leases noted so far, rewritten whole into the file as each is found."""

    def __init__(self, path: Path, endpoints: list[str]) -> None:
        self.path = path
        self.endpoints = endpoints
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
                    lease = await asyncio.to_thread(lease_of, self.endpoints, key)
                except (ConnectionError, ValueError) as e:
                    if str(e) != error:  # said once, not at every poll
                        log.warning("the etcd lease of %s not read (%s): trying again", key, e)
                    error, lease = str(e), None
                if lease is not None:
                    if lease:
                        self._add(lease)
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
