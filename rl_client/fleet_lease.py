"""One writer per fleet: the lease a fleet refit holds while it changes weights.

Two trainers (or two clients in one trainer) refitting one fleet at once would
pause, load and resume over each other and publish each other's records. So a
refit first takes the fleet's lease, kept in the same store as the committed
record; a second writer is refused at once (``LeaseHeld``, naming the holder
and when its lease runs out), and a lease whose holder died expires:

- **file** (one machine): ``<record>.lease`` holds the holder, a random token
  and the expiry, each look-then-write under an exclusive ``flock`` of the
  folder; an expired (or unreadable) lease is taken over.
- **etcd** (cluster mode): the key ``<record key>/lease``, put under an etcd
  lease of ``ttl_s`` in a transaction that succeeds only when the key does not
  exist; etcd removes it when the lease is not kept alive.

The holder renews every ``ttl_s / 3`` while it works (``FleetCycle`` does).
Blocking calls: async callers run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rl_client import etcd_gateway

log = logging.getLogger(__name__)

__all__ = [
    "EtcdFleetLease",
    "FileFleetLease",
    "FleetLease",
    "Holder",
    "LeaseHeld",
    "LeaseLost",
    "Leased",
    "default_owner",
    "holding",
]

# A lease record is a hundred bytes; anything much larger is not one.
_MAX_LEASE_BYTES = 4096


def default_owner() -> str:
    """Who holds a lease, as a person reading a refusal wants to know it."""
    return f"{socket.gethostname()} pid {os.getpid()}"


@dataclass(frozen=True)
class Holder:
    """The writer holding a fleet's lease now."""

    owner: str
    token: str
    expires_unix_s: float

    def describe(self) -> str:
        left = self.expires_unix_s - time.time()
        return f"{self.owner} (its lease runs out in {max(left, 0.0):.1f} s unless renewed)"

    def to_json(self) -> bytes:
        return json.dumps(
            {"owner": self.owner, "token": self.token, "expires_unix_s": self.expires_unix_s}
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Holder | None:
        """The holder, or None for anything that is not a lease (taken over)."""
        try:
            data = json.loads(raw) if len(raw) <= _MAX_LEASE_BYTES else None
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        owner, token, expires = data.get("owner"), data.get("token"), data.get("expires_unix_s")
        if not isinstance(owner, str) or not isinstance(token, str):
            return None
        if isinstance(expires, bool) or not isinstance(expires, (int, float)):
            return None
        return cls(owner[:200], token[:64], float(expires))


class LeaseHeld(RuntimeError):
    """Another writer holds the fleet's lease: this refit did not start."""

    def __init__(self, where: str, holder: Holder | None) -> None:
        who = holder.describe() if holder is not None else "another writer"
        super().__init__(
            f"the fleet's refit lease ({where}) is held by {who}: another trainer is "
            "refitting this fleet; nothing was changed"
        )
        self.holder = holder


class LeaseLost(RuntimeError):
    """The lease ran out (or was taken over) while its holder worked."""


class FleetLease(Protocol):
    def acquire(self, owner: str, ttl_s: float) -> str:
        """The lease's token; LeaseHeld when another writer holds it."""

    def renew(self, token: str, ttl_s: float) -> None:
        """Extended by ``ttl_s``; LeaseLost when it is no longer this token's."""

    def release(self, token: str) -> None:
        """Given up (nothing when it is no longer this token's)."""


class FileFleetLease:
    """The lease as a file next to the record (Dynamo's file store, one machine).

    Every look-then-write (acquire, renew, release) runs under an exclusive
    ``flock`` of the record's folder, so two writers never both judge the lease
    free; the lease itself is a complete file renamed into place. The kernel
    drops the flock with its process: a writer that dies mid-acquire blocks
    nobody, and one that dies holding the lease leaves it to expire."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def holder(self) -> Holder | None:
        """Who holds it (None: nobody, or what is there is not a lease)."""
        try:
            with open(self.path, "rb", opener=_no_follow) as f:
                return Holder.from_json(f.read(_MAX_LEASE_BYTES + 1))
        except OSError:
            return None

    def _write(self, holder: Holder) -> None:
        fd, tmp = tempfile.mkstemp(
            prefix=f".tmp_{self.path.name}.{os.getpid()}.{threading.get_ident()}.",
            dir=self.path.parent,
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(holder.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def acquire(self, owner: str, ttl_s: float) -> str:
        token = secrets.token_hex(16)
        with self._exclusive():
            holder = self.holder()
            if holder is not None and holder.expires_unix_s > time.time():
                raise LeaseHeld(str(self.path), holder)
            self._write(Holder(owner, token, time.time() + ttl_s))  # free, expired or junk
        return token

    def renew(self, token: str, ttl_s: float) -> None:
        with self._exclusive():
            holder = self.holder()
            if holder is None or holder.token != token:
                raise LeaseLost(f"the fleet's refit lease {self.path} is no longer this writer's")
            self._write(Holder(holder.owner, token, time.time() + ttl_s))

    def release(self, token: str) -> None:
        with self._exclusive():
            holder = self.holder()
            if holder is not None and holder.token == token:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


class EtcdFleetLease:
    """The lease as an etcd key under an etcd lease (cluster mode)."""

    def __init__(self, endpoints: Sequence[str], key: bytes, *, timeout_s: float = 5.0) -> None:
        self.endpoints = etcd_gateway.clean_endpoints(endpoints)
        self.key = key
        self.timeout_s = timeout_s
        # token -> the etcd lease id it is kept under.
        self._ids: dict[str, str] = {}

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return etcd_gateway.call(self.endpoints, path, body, self.timeout_s)

    def acquire(self, owner: str, ttl_s: float) -> str:
        granted = self._call("lease/grant", {"TTL": max(1, round(ttl_s))})
        lease_id = str(granted.get("ID", ""))
        if not lease_id or lease_id == "0":
            raise ConnectionError(f"etcd granted no lease: {str(granted)[:200]}")
        token = secrets.token_hex(16)
        key = etcd_gateway.b64(self.key)
        value = etcd_gateway.b64(Holder(owner, token, time.time() + ttl_s).to_json())
        answer = self._call(
            "kv/txn",
            {
                "compare": [
                    {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [{"request_put": {"key": key, "value": value, "lease": lease_id}}],
                "failure": [{"request_range": {"key": key}}],
            },
        )
        if answer.get("succeeded"):
            self._ids[token] = lease_id
            return token
        with contextlib.suppress(Exception):
            self._call("lease/revoke", {"ID": lease_id})
        raise LeaseHeld(f"etcd key {self.key.decode(errors='replace')}", _held(answer))

    def renew(self, token: str, ttl_s: float) -> None:
        lease_id = self._ids.get(token)
        if lease_id is None:
            raise LeaseLost("not a lease this client holds")
        answer = self._call("lease/keepalive", {"ID": lease_id})
        if "error" in answer:  # the gateway's stream error (a leader change, say)
            raise ConnectionError(f"etcd keepalive: {str(answer['error'])[:200]}")
        result = answer.get("result", answer)
        if not isinstance(result, dict) or int(result.get("TTL", 0) or 0) <= 0:
            self._ids.pop(token, None)
            raise LeaseLost(
                f"the fleet's refit lease (etcd key {self.key.decode(errors='replace')}) "
                "expired before it was renewed"
            )

    def release(self, token: str) -> None:
        lease_id = self._ids.pop(token, None)
        if lease_id is not None:
            self._call("lease/revoke", {"ID": lease_id})


def _release_late(lease: FleetLease, acquiring: asyncio.Future[str]) -> None:
    """A lease granted after its caller left: given back at once."""
    if acquiring.cancelled() or acquiring.exception() is not None:
        return
    token = acquiring.result()
    threading.Thread(target=lease.release, args=(token,), daemon=True).start()


def _held(answer: dict[str, Any]) -> Holder | None:
    """The holder a failed transaction read back, when it says."""
    with contextlib.suppress(Exception):
        kvs = answer["responses"][0]["response_range"]["kvs"]
        return Holder.from_json(etcd_gateway.b64decode(kvs[0]["value"]))
    return None


@dataclass
class Leased:
    """A lease this writer holds, renewed in the background. ``lost`` says why it
    was lost; ``expires`` (monotonic) is when it runs out unless renewed: past
    it, a store that stopped answering may have let another writer in. The
    writer must not publish once ``lost_reason()`` says anything."""

    lost: str | None = None
    expires: float = math.inf
    _renew: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    def lost_reason(self) -> str | None:
        if self.lost is None and time.monotonic() > self.expires:
            return "the fleet's refit lease was not renewed within its time to live"
        return self.lost

    async def renew(self) -> None:
        """Renew now (before the commit point); a failure is kept in ``lost``."""
        if self._renew is not None:
            await self._renew()


@contextlib.asynccontextmanager
async def holding(lease: FleetLease, owner: str, ttl_s: float) -> AsyncIterator[Leased]:
    """Hold ``lease`` for the block (LeaseHeld at once when another writer does),
    renewed every ``ttl_s / 3``, released at the end however the block ends (a
    caller cancelled while the store grants it releases it once granted)."""
    granted = time.monotonic()
    acquiring = asyncio.ensure_future(asyncio.to_thread(lease.acquire, owner, ttl_s))
    try:
        token = await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        acquiring.add_done_callback(lambda done: _release_late(lease, done))
        raise
    held = Leased(expires=granted + ttl_s)

    async def renew_once() -> None:
        started = time.monotonic()
        try:
            await asyncio.to_thread(lease.renew, token, ttl_s)
            held.expires = started + ttl_s
        except LeaseLost as e:
            held.lost = str(e)
        except Exception as e:  # the store may answer the next time: keep trying
            log.warning("renewing the fleet's refit lease failed: %s", e)

    held._renew = renew_once

    async def renew() -> None:
        while held.lost is None:
            await asyncio.sleep(ttl_s / 3)
            await renew_once()

    renewing = asyncio.get_running_loop().create_task(renew(), name="fleet-lease")
    try:
        yield held
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        try:
            await asyncio.to_thread(lease.release, token)
        except Exception as e:  # it expires with its TTL
            log.warning("releasing the fleet's refit lease failed (it expires): %s", e)
