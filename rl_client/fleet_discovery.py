"""The fleet's workers, found through Dynamo's own discovery records.

A trainer's fleet refit (``rl_client.refit``) needs every worker's RL admin URL
(its system port) or its engine server's address. Each bridge publishes them
where Dynamo already publishes what a worker serves: its model deployment card
(MDC), in the card's runtime config, ``runtime_config.runtime_data["rl_worker"]``
(``EngineConfig.runtime_data``; ``ModelRuntimeConfig.set_engine_specific`` writes
the same map)::

    {"schema": 1, "admin_url": "http://10.0.0.5:9090", "engine_address": "unix:/...",
     "engine_tls": false}

Dynamo keeps one card per registered instance, beside the instance's own record,
both under the worker's lease:

- ``etcd`` (cluster mode, ``ETCD_ENDPOINTS``): the keys
  ``v1/mdc/<namespace>/<component>/<endpoint>/<instance id, hex>`` and
  ``v1/instances/<namespace>/<component>/<endpoint>/<instance id, hex>``, read
  here in one transaction over etcd's v3 JSON gateway (one revision: no etcd
  client library, no Dynamo);
- ``file`` (one machine, ``DYN_FILE_KV``): the files ``$DYN_FILE_KV/v1/mdc/...``
  and ``$DYN_FILE_KV/v1/instances/...`` (the key, percent-encoded), renewed every
  few seconds while the worker lives.

A worker is *live* while its instance record is there: a bridge that leaves the
router's pool (its engine not serving, a catch-up under way) removes it and keeps
its card; a bridge that exits removes both; a worker that died without a word
loses them when its lease ends (etcd) or, in the file store, once the files are
older than the store's TTL (10 s in Dynamo 1.6.1), which this reader applies
itself as Dynamo's watchers do. So ``workers()`` answers with the workers that
serve now, the way the router sees them.

    from rl_client.fleet_discovery import fleet_discovery

    for worker in fleet_discovery("rl").workers():
        worker.admin_url, worker.engine_address

No Dynamo import: trainers install only the ``driver`` extra, and the bridge
writes its record with ``worker_runtime_data`` from here.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rl_client import etcd_gateway
from rl_client.committed import file_store_root

log = logging.getLogger(__name__)

# The bridge's entry in its card's runtime_config.runtime_data.
RUNTIME_DATA_KEY = "rl_worker"
SCHEMA = 1
# Dynamo 1.6.1's file store: a record not renewed for this long is expired.
FILE_STORE_TTL_S = 10.0
# The endpoint a bridge registers its model on.
GENERATE = "generate"


def worker_runtime_data(
    *, admin_url: str | None, engine_address: str, engine_tls: bool
) -> dict[str, Any]:
    """The entry a bridge puts in its card's ``runtime_data`` (under ``RUNTIME_DATA_KEY``)."""
    return {
        "schema": SCHEMA,
        "admin_url": admin_url,
        "engine_address": engine_address,
        "engine_tls": engine_tls,
    }


@dataclass(frozen=True)
class FleetWorker:
    """One live worker, as its bridge published it. ``admin_url``: its RL admin
    routes (None: the bridge serves none, ``--no-rl-routes`` or no system port);
    ``engine_address``: its engine server as the bridge dials it (a loopback or
    ``unix:`` address reaches it only from the worker's machine); ``engine_tls``:
    the bridge dials it over TLS (a trainer needs ``tls=`` too)."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    model: str
    admin_url: str | None
    engine_address: str | None
    engine_tls: bool = False


class FleetDiscovery(Protocol):
    """Where the fleet's workers are listed. A blocking call (files, or one HTTP
    request with a deadline): async callers run it with ``asyncio.to_thread``."""

    def workers(self) -> list[FleetWorker]:
        """The live workers that published an RL record, ordered by instance id."""


def _check_name(what: str, value: str) -> None:
    if not value or "/" in value:
        raise ValueError(f"{what} {value!r}: must be a non-empty name without '/'")


def _record(value: Any) -> dict[str, Any] | None:
    """A JSON object, or None for anything else."""
    return value if isinstance(value, dict) else None


def _identity(record: Mapping[str, Any]) -> tuple[str, str, str, int] | None:
    """(namespace, component, endpoint, instance id) of an instance or card record."""
    fields = tuple(record.get(k) for k in ("namespace", "component", "endpoint", "instance_id"))
    namespace, component, endpoint, instance_id = fields
    if not all(isinstance(f, str) for f in (namespace, component, endpoint)):
        return None
    if not isinstance(instance_id, int) or isinstance(instance_id, bool):
        return None
    return str(namespace), str(component), str(endpoint), instance_id


def _rl_entry(card: Mapping[str, Any]) -> dict[str, Any] | None:
    """The bridge's entry in a card, if it has one this reader understands."""
    card_json = _record(card.get("card_json")) or {}
    runtime = _record(card_json.get("runtime_config")) or {}
    data = _record(runtime.get("runtime_data")) or {}
    entry = _record(data.get(RUNTIME_DATA_KEY))
    if entry is None:
        return None
    if entry.get("schema") != SCHEMA:
        log.warning(
            "a worker's %s entry has schema %r; this reader knows %d: skipped",
            RUNTIME_DATA_KEY,
            entry.get("schema"),
            SCHEMA,
        )
        return None
    return entry


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def join(
    cards: Iterable[Mapping[str, Any]],
    instances: Iterable[Mapping[str, Any]],
    namespace: str,
    component: str,
    endpoint: str = GENERATE,
) -> list[FleetWorker]:
    """The workers whose card (with an RL entry) has a live instance record."""
    ours = (namespace, component, endpoint)
    live = {
        ident
        for record in instances
        if (ident := _identity(record)) is not None and ident[:3] == ours
    }
    workers = []
    for card in cards:
        ident = _identity(card)
        if ident is None or ident not in live:
            continue
        entry = _rl_entry(card)
        if entry is None:
            continue
        card_json = _record(card.get("card_json")) or {}
        model = card_json.get("display_name") or card_json.get("slug") or ""
        workers.append(
            FleetWorker(
                namespace=ident[0],
                component=ident[1],
                endpoint=ident[2],
                instance_id=ident[3],
                model=str(model),
                admin_url=_optional_str(entry.get("admin_url")),
                engine_address=_optional_str(entry.get("engine_address")),
                engine_tls=entry.get("engine_tls") is True,
            )
        )
    return sorted(workers, key=lambda w: w.instance_id)


def _parse(raw: bytes, where: str) -> dict[str, Any] | None:
    try:
        return _record(json.loads(raw))
    except (ValueError, UnicodeDecodeError) as e:
        log.warning("discovery record %s is not JSON (%s): skipped", where, e)
        return None


class FileFleetDiscovery:
    """The workers in Dynamo's file store (one machine). ``ttl_s``: a record not
    renewed for this long belongs to a worker that died without a word."""

    def __init__(
        self,
        root: Path,
        namespace: str,
        component: str = "backend",
        *,
        endpoint: str = GENERATE,
        ttl_s: float = FILE_STORE_TTL_S,
    ) -> None:
        for what, value in (("namespace", namespace), ("component", component)):
            _check_name(what, value)
        _check_name("endpoint", endpoint)
        self.root = root
        self.namespace, self.component, self.endpoint = namespace, component, endpoint
        self.ttl_s = ttl_s

    def _records(self, bucket: str, now: float) -> list[dict[str, Any]]:
        folder = self.root / "v1" / bucket
        prefix = f"{self.namespace}/{self.component}/{self.endpoint}/"
        records = []
        try:
            paths = list(folder.iterdir())
        except FileNotFoundError:
            return []
        for path in paths:
            # Dynamo writes through ".tmp_" names, then renames.
            if path.name.startswith(".") or not urllib.parse.unquote(path.name).startswith(prefix):
                continue
            try:
                if now - path.stat().st_mtime > self.ttl_s:
                    continue  # expired: its worker stopped renewing it
                raw = path.read_bytes()
            except OSError:  # removed meanwhile: gone
                continue
            record = _parse(raw, str(path))
            if record is not None:
                records.append(record)
        return records

    def workers(self) -> list[FleetWorker]:
        now = time.time()
        # Instances last: a worker that left between the two reads is not listed.
        cards = self._records("mdc", now)
        instances = self._records("instances", now)
        return join(cards, instances, self.namespace, self.component, self.endpoint)


def _prefix_range(prefix: str) -> dict[str, str]:
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    return {"key": etcd_gateway.b64(start), "range_end": etcd_gateway.b64(end)}


class EtcdFleetDiscovery:
    """The workers in etcd (cluster mode), read at one revision over etcd's v3 JSON
    gateway. ``endpoints``: as ``ETCD_ENDPOINTS`` lists them; each is tried in turn."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        component: str = "backend",
        *,
        endpoint: str = GENERATE,
        timeout_s: float = 5.0,
    ) -> None:
        for what, value in (("namespace", namespace), ("component", component)):
            _check_name(what, value)
        _check_name("endpoint", endpoint)
        self.endpoints = etcd_gateway.clean_endpoints(endpoints)
        self.namespace, self.component, self.endpoint = namespace, component, endpoint
        self.timeout_s = timeout_s

    def _txn(self, body: dict[str, Any]) -> dict[str, Any]:
        return etcd_gateway.call(self.endpoints, "kv/txn", body, self.timeout_s)

    def workers(self) -> list[FleetWorker]:
        key = f"{self.namespace}/{self.component}/{self.endpoint}/"
        answer = self._txn(
            {
                "compare": [],
                "success": [
                    {"request_range": _prefix_range(f"v1/mdc/{key}")},
                    {"request_range": _prefix_range(f"v1/instances/{key}")},
                ],
            }
        )
        responses = answer.get("responses") or []
        if len(responses) != 2:
            raise ConnectionError(f"etcd kv/txn answered {len(responses)} ranges, not 2")
        cards, instances = (
            [
                record
                for kv in (r.get("response_range") or r.get("responseRange") or {}).get("kvs", [])
                if (record := _parse(base64.b64decode(kv.get("value", "")), kv.get("key", "")))
                is not None
            ]
            for r in responses
        )
        return join(cards, instances, self.namespace, self.component, self.endpoint)


def fleet_discovery(
    namespace: str,
    component: str = "backend",
    *,
    endpoint: str = GENERATE,
    env: Mapping[str, str] = os.environ,
) -> FleetDiscovery:
    """The discovery Dynamo's processes with this environment use, as
    ``rl_client.committed.committed_store`` picks it: etcd (Dynamo's default;
    ``ETCD_ENDPOINTS``, default ``http://localhost:2379``) or its files."""
    backend = env.get("DYN_DISCOVERY_BACKEND", "etcd")
    if backend == "file":
        return FileFleetDiscovery(file_store_root(env), namespace, component, endpoint=endpoint)
    if backend == "etcd":
        endpoints = etcd_gateway.env_endpoints(env)
        return EtcdFleetDiscovery(endpoints, namespace, component, endpoint=endpoint)
    raise ValueError(
        f"DYN_DISCOVERY_BACKEND={backend!r}: workers are listed from etcd or Dynamo's "
        "file store only"
    )


def discover_workers(
    namespace: str,
    component: str = "backend",
    *,
    model: str | None = None,
    discovery: FleetDiscovery | None = None,
) -> list[FleetWorker]:
    """The live workers of ``namespace``/``component`` (serving ``model``, when
    given), from ``discovery`` (default: ``fleet_discovery`` for this environment)."""
    found = (discovery or fleet_discovery(namespace, component)).workers()
    return [w for w in found if model is None or w.model == model]
