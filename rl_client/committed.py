"""The fleet's committed weights: what every worker serves once a fleet refit commits.

A trainer's fleet refit (``rl_client.fleet_cycle``) is all or nothing, so after it the
whole fleet serves one version, and the trainer publishes that version and where
its weights come from (a checkpoint folder, or pushed by the trainer) in
Dynamo's discovery store, next to the workers' own records. A worker that
(re)starts can then read what it must serve before it takes traffic (the bridge
reads it with the same class), and a trainer that restarts knows what to roll
back to.

The store is the one Dynamo's processes already use, read as Dynamo reads its
settings (``DYN_DISCOVERY_BACKEND``, default etcd):

- ``etcd`` (cluster mode, ``ETCD_ENDPOINTS``): the key
  ``v1/rl_weights/<namespace>/<component>``, written with no lease (it outlives
  every process), over etcd's v3 JSON gateway: no etcd client library, no Dynamo.
- ``file`` (one machine, ``DYN_FILE_KV``): the file
  ``$DYN_FILE_KV/v1/rl_weights/<namespace>%2F<component>``, written atomically
  as Dynamo's file store writes its own. No Dynamo process opens this bucket,
  so none expires it (Dynamo expires files only in the buckets it keeps alive).

No Dynamo import: trainers install only the ``driver`` extra, and the bridge
reads the record with the same code.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine_contract.labels import label_problem
from engine_contract.tensors import Tensor
from rl_client import etcd_gateway

# Where the record lives in the store (Dynamo's buckets are v1/<name>).
BUCKET = "v1/rl_weights"
SCHEMA = 1
CHECKPOINT = "checkpoint"
PUSHED = "pushed"


@dataclass(frozen=True)
class CheckpointSource:
    """Weights loaded from a checkpoint folder every worker can read at ``path``."""

    path: str


@dataclass(frozen=True)
class PushedSource:
    """Weights pushed by the trainer (streamed over the contract). ``tensors``: the
    trainer's copy of them, what a rollback re-sends (None once only the record is
    known: such weights cannot be sent again)."""

    tensors: Sequence[Tensor] | None = field(default=None, repr=False, compare=False)


WeightSource = CheckpointSource | PushedSource


@dataclass(frozen=True)
class CommittedWeights:
    """What the whole fleet serves: the version label and where its weights come from."""

    version: str
    source: WeightSource

    def __post_init__(self) -> None:
        problem = label_problem(self.version)
        if problem is not None:
            raise ValueError(f"version {self.version!r}: {problem}")

    @property
    def resendable(self) -> bool:
        """Whether a worker can be brought back to these weights by the trainer."""
        return isinstance(self.source, CheckpointSource) or self.source.tensors is not None


@dataclass(frozen=True)
class CommittedRecord:
    """The record in the store: the committed weights, which workers committed them,
    and when (seconds since the epoch)."""

    weights: CommittedWeights
    workers: tuple[str, ...] = ()
    committed_unix_s: float = 0.0

    def to_json(self) -> bytes:
        source = self.weights.source
        return json.dumps(
            {
                "schema": SCHEMA,
                "version": self.weights.version,
                "source": CHECKPOINT if isinstance(source, CheckpointSource) else PUSHED,
                "path": source.path if isinstance(source, CheckpointSource) else None,
                "workers": list(self.workers),
                "committed_unix_s": self.committed_unix_s,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CommittedRecord:
        """The record, or ValueError naming what is wrong (a newer schema included:
        a reader must not guess at fields it does not know)."""
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"the committed-weights record is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("the committed-weights record is not a JSON object")
        if value.get("schema") != SCHEMA:
            raise ValueError(
                f"the committed-weights record has schema {value.get('schema')!r}; "
                f"this reader knows {SCHEMA}"
            )
        version, kind, path = value.get("version"), value.get("source"), value.get("path")
        if not isinstance(version, str):
            raise ValueError("the committed-weights record has no version")
        source: WeightSource
        if kind == CHECKPOINT and isinstance(path, str) and path:
            source = CheckpointSource(path)
        elif kind == PUSHED:
            source = PushedSource()
        else:
            raise ValueError(f"the committed-weights record has source {kind!r}, path {path!r}")
        workers = value.get("workers", [])
        when = value.get("committed_unix_s", 0.0)
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise ValueError("the committed-weights record's workers are not a list of names")
        if not isinstance(when, int | float):
            raise ValueError("the committed-weights record's committed_unix_s is not a number")
        return cls(CommittedWeights(version, source), tuple(workers), float(when))

    @classmethod
    def now(cls, weights: CommittedWeights, workers: Sequence[str]) -> CommittedRecord:
        return cls(weights, tuple(workers), time.time())


class CommittedStore(Protocol):
    """Where the fleet's record lives. Blocking calls (a file, or one HTTP request
    with a deadline): async callers run them with ``asyncio.to_thread``."""

    def read(self) -> CommittedRecord | None:
        """The record, or None when none was ever published."""

    def publish(self, record: CommittedRecord) -> None: ...

    def delete(self) -> None:
        """No record (what the store held before the first publish)."""


def record_key(namespace: str, component: str) -> str:
    """The record's key inside the bucket: one record per served component."""
    for what, value in (("namespace", namespace), ("component", component)):
        if not value or "/" in value:
            raise ValueError(f"{what} {value!r}: must be a non-empty name without '/'")
    return f"{namespace}/{component}"


def file_store_root(env: Mapping[str, str] = os.environ) -> Path:
    """The folder of Dynamo's file discovery (``DYN_FILE_KV``, else its default)."""
    root = env.get("DYN_FILE_KV")
    if root:
        return Path(root)
    return Path(env.get("TMPDIR", "/tmp")) / "dynamo_store_kv"


class FileCommittedStore:
    """The record as one file of Dynamo's file store (one machine)."""

    def __init__(self, root: Path, namespace: str, component: str = "backend") -> None:
        key = record_key(namespace, component)
        self.path = root / BUCKET / urllib.parse.quote(key, safe="")

    def read(self) -> CommittedRecord | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return CommittedRecord.from_json(raw)

    def publish(self, record: CommittedRecord) -> None:
        # Atomic, as Dynamo's store writes (its watchers skip ".tmp_" names): a
        # reader sees the old record or the new one, never half of one.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.parent / f".tmp_{self.path.name}.{os.getpid()}"
        tmp.write_bytes(record.to_json())
        os.replace(tmp, self.path)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)


class EtcdCommittedStore:
    """The record as one etcd key with no lease (cluster mode), over etcd's v3 JSON
    gateway. ``endpoints``: as ``ETCD_ENDPOINTS`` lists them; each is tried in turn."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        component: str = "backend",
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self.endpoints = etcd_gateway.clean_endpoints(endpoints)
        self.key = f"{BUCKET}/{record_key(namespace, component)}".encode()
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return etcd_gateway.call(self.endpoints, path, body, self.timeout_s)

    def read(self) -> CommittedRecord | None:
        answer = self._call("kv/range", {"key": etcd_gateway.b64(self.key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        return CommittedRecord.from_json(base64.b64decode(kvs[0].get("value", "")))

    def publish(self, record: CommittedRecord) -> None:
        value = etcd_gateway.b64(record.to_json())
        self._call("kv/put", {"key": etcd_gateway.b64(self.key), "value": value})

    def delete(self) -> None:
        self._call("kv/deleterange", {"key": etcd_gateway.b64(self.key)})


def committed_store(
    namespace: str, component: str = "backend", *, env: Mapping[str, str] = os.environ
) -> CommittedStore:
    """The store Dynamo's processes with this environment use: etcd (Dynamo's
    default; ``ETCD_ENDPOINTS``, default ``http://localhost:2379``) or its files."""
    backend = env.get("DYN_DISCOVERY_BACKEND", "etcd")
    if backend == "file":
        return FileCommittedStore(file_store_root(env), namespace, component)
    if backend == "etcd":
        return EtcdCommittedStore(etcd_gateway.env_endpoints(env), namespace, component)
    raise ValueError(
        f"DYN_DISCOVERY_BACKEND={backend!r}: the committed-weights record is kept in etcd "
        "or Dynamo's file store only"
    )
