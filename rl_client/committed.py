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

Writing is a compare-and-set (``swap``): a record is replaced only while it
still holds what its writer read, so two writers never restore or overwrite
each other's commit. Writers take the fleet's lease first
(``rl_client.fleet_lease``, the same store).

Reading never blocks or crashes, whatever the store holds (``committed_strict``):
the record is at most ``MAX_RECORD_BYTES``, a regular file opened without
blocking, and anything else (a FIFO, a folder, bad or hostile JSON) is a
ValueError naming what is wrong, so a catching-up bridge logs it and a trainer
given ``committed=`` writes over it.

No Dynamo import: trainers install only the ``driver`` extra, and the bridge
reads the record with the same code.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
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
from rl_client.committed_strict import brief, check_size, decode_base64, parse, read_capped
from rl_client.fleet_lease import EtcdFleetLease, FileFleetLease, FleetLease

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
        """The record as stored; ValueError when it is larger than a reader takes."""
        source = self.weights.source
        raw = json.dumps(
            {
                "schema": SCHEMA,
                "version": self.weights.version,
                "source": CHECKPOINT if isinstance(source, CheckpointSource) else PUSHED,
                "path": source.path if isinstance(source, CheckpointSource) else None,
                "workers": list(self.workers),
                "committed_unix_s": self.committed_unix_s,
            },
            sort_keys=True,
            allow_nan=False,
        ).encode()
        check_size(len(raw))
        return raw

    @classmethod
    def from_json(cls, raw: bytes) -> CommittedRecord:
        """The record, or ValueError naming what is wrong (a newer schema included:
        a reader must not guess at fields it does not know). Only ValueError, so a
        hostile record cannot crash its reader or block a writer replacing it."""
        value = parse(raw)
        if not isinstance(value, dict):
            raise ValueError("the committed-weights record is not a JSON object")
        schema = value.get("schema")
        if type(schema) is not int or schema != SCHEMA:
            raise ValueError(
                f"the committed-weights record has schema {brief(schema)}; "
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
            raise ValueError(
                f"the committed-weights record has source {brief(kind)}, path {brief(path)}"
            )
        workers = value.get("workers", [])
        when = value.get("committed_unix_s", 0.0)
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise ValueError("the committed-weights record's workers are not a list of names")
        if type(when) not in (int, float) or not 0 <= when < 1e12:
            raise ValueError(
                f"the committed-weights record's committed_unix_s is {brief(when)}, "
                "not seconds since the epoch"
            )
        return cls(CommittedWeights(version, source), tuple(workers), float(when))

    @classmethod
    def now(cls, weights: CommittedWeights, workers: Sequence[str]) -> CommittedRecord:
        return cls(weights, tuple(workers), time.time())


class Unread:
    """``swap``'s ``expected`` for a record its writer could not read (a FIFO, say):
    replaced whatever it holds."""


UNREAD = Unread()


class RecordChanged(RuntimeError):
    """A compare-and-set found another record than its writer read: not written."""


class CommittedStore(Protocol):
    """Where the fleet's record lives. Blocking calls (a file, or one HTTP request
    with a deadline): async callers run them with ``asyncio.to_thread``."""

    def read(self) -> CommittedRecord | None:
        """The record, or None when none was ever published."""

    def read_raw(self) -> bytes | None:
        """The record's bytes as stored (what ``swap`` compares), unparsed; None
        when there is none; ValueError when what is there cannot be read."""

    def swap(self, expected: bytes | Unread | None, new: bytes | None) -> None:
        """``new`` (None: no record) in place of ``expected``; RecordChanged, nothing
        written, when the store holds anything else."""

    def publish(self, record: CommittedRecord) -> None:
        """Written whatever the store holds (a trainer's ``committed=``)."""

    def delete(self) -> None:
        """No record (what the store held before the first publish)."""

    def lease(self) -> FleetLease:
        """The fleet's one-writer lease, kept beside the record."""


def _changed(expected: bytes | None, found: bytes | None) -> RecordChanged:
    def what(raw: bytes | None) -> str:
        return "no record" if raw is None else brief(raw.decode(errors="replace"))

    return RecordChanged(
        f"the committed-weights record changed since it was read (expected {what(expected)}, "
        f"found {what(found)}): another writer published meanwhile; not written"
    )


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
        raw = read_capped(self.path)
        return None if raw is None else CommittedRecord.from_json(raw)

    def read_raw(self) -> bytes | None:
        return read_capped(self.path)

    def lease(self) -> FleetLease:
        return FileFleetLease(self.path.with_name(f"{self.path.name}.lease"))

    def swap(self, expected: bytes | Unread | None, new: bytes | None) -> None:
        # One file cannot be compared and renamed in one step: the compare holds
        # against every writer that takes the fleet's lease first (they all do).
        if not isinstance(expected, Unread):
            try:
                found = read_capped(self.path)
            except ValueError as e:  # not what the writer read, which it could read
                raise RecordChanged(f"{e}; it was readable when read: not written") from e
            if found != expected:
                raise _changed(expected, found)
        if new is None:
            self.delete()
        else:
            self._write(new)

    def publish(self, record: CommittedRecord) -> None:
        self._write(record.to_json())

    def _write(self, raw: bytes) -> None:
        # Atomic, as Dynamo's store writes (its watchers skip ".tmp_" names): a
        # reader sees the old record or the new one, never half of one. The temp
        # name is this writer's own (process, thread, random), so two writers never
        # rename each other's file; a failed write leaves none behind.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".tmp_{self.path.name}.{os.getpid()}.{threading.get_ident()}.",
            dir=self.path.parent,
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())  # the commit point: on disk before it is named
                os.fchmod(f.fileno(), 0o644)  # every worker's bridge reads it (mkstemp: 0600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

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
        """The record, with the file's checks on the value (and on the answer's shape)."""
        raw = self.read_raw()
        return None if raw is None else CommittedRecord.from_json(raw)

    def lease(self) -> FleetLease:
        return EtcdFleetLease(self.endpoints, self.key + b"/lease", timeout_s=self.timeout_s)

    def swap(self, expected: bytes | Unread | None, new: bytes | None) -> None:
        key = etcd_gateway.b64(self.key)
        if isinstance(expected, Unread):
            compare: list[dict[str, Any]] = []
        elif expected is None:
            compare = [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}]
        else:
            value = etcd_gateway.b64(expected)
            compare = [{"key": key, "target": "VALUE", "result": "EQUAL", "value": value}]
        change: dict[str, Any] = (
            {"request_delete_range": {"key": key}}
            if new is None
            else {"request_put": {"key": key, "value": etcd_gateway.b64(new)}}
        )
        answer = self._call("kv/txn", {"compare": compare, "success": [change]})
        if not answer.get("succeeded"):
            try:
                found = self.read_raw()
            except ValueError:
                found = None
            if not isinstance(expected, Unread):
                raise _changed(expected, found)

    def read_raw(self) -> bytes | None:
        answer: object = self._call("kv/range", {"key": etcd_gateway.b64(self.key)})
        if not isinstance(answer, dict):
            raise ValueError(f"etcd's answer is not a JSON object: {brief(answer)}")
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list) or not all(isinstance(kv, dict) for kv in kvs):
            raise ValueError(f"etcd's answer has kvs {brief(kvs)}, not a list of objects")
        if not kvs:
            return None
        value = kvs[0].get("value", "")
        if not isinstance(value, str):
            raise ValueError(f"etcd's answer has value {brief(value)}, not base64 text")
        return decode_base64(value, "etcd")

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
