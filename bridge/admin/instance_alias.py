"""The ``rl`` endpoint's discovery record under the worker's own instance id.

dynamo.vllm serves ``generate`` and ``rl`` from one runtime, so both carry one
instance id, and NeMo RL's readiness wait (``ManagedDynamoRuntime._wait_for_frontend``)
counts a worker only when the two ids are equal. A Python ``LLMEngine`` never gets
its worker's runtime (Dynamo 1.3 to 1.6 keep it inside the Rust ``Worker``), so the
bridge serves ``rl`` from a second runtime of its own, the *carrier*, registered as
``<namespace>/<component>_rl/carrier``. This module then publishes the carrier's
own record again, as Dynamo wrote it, under ``<namespace>/<component>/rl/<worker
id>``: the same transport (the carrier's address and path, which its
request-plane server answers on), the worker's component, instance id and the
endpoint name ``rl``. Requests routed to that id reach the carrier. The carrier's
own endpoint is not called ``rl``: a frontend that lists the ``rl`` endpoints of
a namespace (``DYN_ENABLE_RL``'s ``/v1/rl/workers``) would list each worker twice,
once without its model.

The alias lives as long as the carrier's registration:

- ``etcd``: the alias key is put under the carrier's lease, so it goes when the
  carrier's runtime stops or its lease expires (the bridge died);
- ``file``: the alias file is renewed as Dynamo renews its own, and removed at stop;
  a bridge that died without a word leaves it to expire with the store's TTL.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rl_client import etcd_gateway
from rl_client.committed import file_store_root
from rl_client.fleet_discovery import FILE_STORE_TTL_S

log = logging.getLogger(__name__)

INSTANCES = "v1/instances"
# The file store's records are renewed well inside its TTL.
RENEW_EVERY_S = FILE_STORE_TTL_S / 4
ETCD_TIMEOUT_S = 5.0


# The carrier's endpoint name: anything but "rl" (see above).
CARRIER_ENDPOINT = "carrier"


def carrier_component(component: str) -> str:
    """The component the carrier registers under: never the worker's own, so
    that the worker's ``rl`` endpoint lists one instance (the alias)."""
    return f"{component}_rl"


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """A record's key in Dynamo's store (the instance id in lowercase hex)."""
    return f"{INSTANCES}/{namespace}/{component}/{endpoint}/{instance_id:x}"


def model_card_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """Where Dynamo keeps a worker's model card (``v1/mdc/...``), under the lease its
    instance record has."""
    return f"v1/mdc/{namespace}/{component}/{endpoint}/{instance_id:x}"


def file_name(key_below_bucket: str) -> str:
    """A key as Dynamo's file store names it: every byte but ASCII letters and
    digits percent-encoded (``/`` is ``%2F``, ``_`` is ``%5F``)."""
    return "".join(
        chr(b) if chr(b).isascii() and chr(b).isalnum() else f"%{b:02X}"
        for b in key_below_bucket.encode()
    )


def aliased(
    record: Mapping[str, Any], component: str, instance_id: int, endpoint: str = "rl"
) -> dict[str, Any]:
    """The carrier's record as the worker's: its component, endpoint name and
    instance id replaced, everything else (transport, codec, ...) kept as Dynamo
    wrote it."""
    if not isinstance(record.get("instance_id"), int) or "transport" not in record:
        raise ValueError(f"not a Dynamo instance record: {dict(record)!r}")
    return {**record, "component": component, "endpoint": endpoint, "instance_id": instance_id}


class AliasStore(Protocol):
    renews: bool  # records must be renewed while they live

    async def find(self, key: str) -> tuple[dict[str, Any], Any] | None:
        """The record at ``key`` and what ties it to its owner's life, or None."""

    async def put(self, key: str, record: dict[str, Any], owner: Any) -> None: ...

    async def renew(self, key: str) -> None: ...

    async def remove(self, key: str) -> None: ...


class FileAliasStore:
    """Dynamo's file store (``DYN_FILE_KV``): one file per record, renewed by touch."""

    renews = True

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        bucket, _, rest = key.partition("/")
        sub, _, below = rest.partition("/")
        return self.root / bucket / sub / file_name(below)

    async def find(self, key: str) -> tuple[dict[str, Any], Any] | None:
        try:
            record = json.loads(self._path(key).read_bytes())
        except (OSError, ValueError):
            return None
        return (record, None) if isinstance(record, dict) else None

    async def put(self, key: str, record: dict[str, Any], owner: Any) -> None:
        path = self._path(key)
        # Written through a dot name, then renamed, as Dynamo writes: readers skip dot names.
        tmp = path.with_name(f".tmp_{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, separators=(",", ":")))
        os.replace(tmp, path)

    async def renew(self, key: str) -> None:
        now = time.time()
        os.utime(self._path(key), (now, now))

    async def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()


class EtcdAliasStore:
    """etcd (``ETCD_ENDPOINTS``), over its JSON gateway: the alias shares the
    carrier's lease, so etcd itself removes it with the carrier."""

    renews = False

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = etcd_gateway.clean_endpoints(endpoints)

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(
            etcd_gateway.call, self.endpoints, path, body, ETCD_TIMEOUT_S
        )

    async def find(self, key: str) -> tuple[dict[str, Any], Any] | None:
        answer = await self._call("kv/range", {"key": etcd_gateway.b64(key.encode())})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        record = json.loads(base64.b64decode(kvs[0]["value"]))
        return (record, kvs[0].get("lease")) if isinstance(record, dict) else None

    async def put(self, key: str, record: dict[str, Any], owner: Any) -> None:
        body: dict[str, Any] = {
            "key": etcd_gateway.b64(key.encode()),
            "value": etcd_gateway.b64(json.dumps(record, separators=(",", ":")).encode()),
        }
        if owner:
            body["lease"] = owner
        await self._call("kv/put", body)

    async def renew(self, key: str) -> None:
        return None

    async def remove(self, key: str) -> None:
        await self._call("kv/deleterange", {"key": etcd_gateway.b64(key.encode())})


def alias_store(discovery_backend: str, env: Mapping[str, str] = os.environ) -> AliasStore:
    """The store the worker's runtime registers in; ValueError for one this
    module cannot write (``kubernetes``, ``mem``)."""
    if discovery_backend == "file":
        return FileAliasStore(file_store_root(env))
    if discovery_backend == "etcd":
        return EtcdAliasStore(etcd_gateway.env_endpoints(env))
    raise ValueError(
        f"the rl endpoint under the worker's instance id needs the etcd or file "
        f"discovery backend, not {discovery_backend!r}"
    )


class InstanceAlias:
    """Publishes the carrier's record under the worker's instance id, and keeps it."""

    def __init__(
        self,
        store: AliasStore,
        *,
        namespace: str,
        component: str,
        endpoint: str,
        worker_id: int,
        carrier_id: int,
        carrier_endpoint: str = CARRIER_ENDPOINT,
    ) -> None:
        self.store = store
        self.carrier_key = instance_key(
            namespace, carrier_component(component), carrier_endpoint, carrier_id
        )
        self.key = instance_key(namespace, component, endpoint, worker_id)
        self._component, self._endpoint, self._worker_id = component, endpoint, worker_id
        self._renewing: asyncio.Task[None] | None = None

    async def publish(self, timeout_s: float = 30.0) -> None:
        """Wait for the carrier's own record, then publish the alias (and renew it
        where the store needs that). TimeoutError when the carrier never registers."""
        deadline = time.monotonic() + timeout_s
        while not await self._put():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the rl carrier never registered ({self.carrier_key})")
            await asyncio.sleep(0.05)
        log.info("rl endpoint published under the worker's instance id at %s", self.key)
        if self.store.renews:
            self._renewing = asyncio.create_task(self._renew())

    async def _put(self) -> bool:
        """The alias written from the carrier's record; False while there is none."""
        found = await self.store.find(self.carrier_key)
        if found is None:
            return False
        record, owner = found
        alias = aliased(record, self._component, self._worker_id, self._endpoint)
        await self.store.put(self.key, alias, owner)
        return True

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.store.renew(self.key)
            except OSError as e:  # removed by hand, or the store wiped: publish it again
                log.warning("rl alias %s not renewed (%s): publishing it again", self.key, e)
                with contextlib.suppress(OSError):
                    await self._put()

    async def withdraw(self) -> None:
        renewing, self._renewing = self._renewing, None
        if renewing is not None:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        try:
            await self.store.remove(self.key)
        except (OSError, ConnectionError) as e:
            log.warning("rl alias %s not removed (%s): it expires with its lease", self.key, e)
