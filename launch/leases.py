"""A dead bridge's etcd leases, revoked by its supervisor as soon as it dies.

With etcd discovery, a worker's records (its instance, model card and KV-event
channels under its runtime's lease; the ``rl`` alias under the carrier's) live
as long as their leases, which the bridge's runtimes keep alive. A bridge that
dies without a word (SIGKILL, the OOM killer, a crash) leaves them until they
expire, up to the lease TTL later (``ETCD_LEASE_TTL``: 10 s by default at
ai-dynamo 1.3, 30 s at 1.6.1). Meanwhile the frontend routes requests to an
instance nobody serves, and NeMo RL's readiness rule (one id per worker) does
not hold, since the dead id and its successor's are both listed.

So the bridge writes the leases its records hold to a file its supervisor names
(``LEASES_FILE_ENV``; ``bridge.lease_note``), and the supervisor, when the
bridge has exited and before it starts the next one, revokes them: etcd deletes
the records at once. A bridge that exited 0 ended in order and took its records
out itself: nothing is revoked. A lease found gone already (expired, or revoked
by a bridge that failed as it ended) is no error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rl_client import etcd_gateway

log = logging.getLogger(__name__)

# The file the bridge notes its leases in (set by its supervisor).
LEASES_FILE_ENV = "BRIDGE_LEASES_FILE"
FILE_NAME = "bridge-leases.json"
# Each etcd call's bound: a supervisor waits for them before it restarts the bridge.
REVOKE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Leases:
    """Where and which: the etcd endpoints the bridge registered with, its leases."""

    endpoints: tuple[str, ...]
    ids: tuple[int, ...]


def write(path: Path, leases: Leases) -> None:
    """``leases`` into ``path``, whole or not at all (a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"endpoints": list(leases.endpoints), "ids": list(leases.ids)}))
    os.replace(tmp, path)


def read(path: Path) -> Leases | None:
    """What ``path`` names; None when there is no such file, or it is not a note."""
    try:
        data = json.loads(path.read_text())
        return Leases(tuple(str(e) for e in data["endpoints"]), tuple(int(i) for i in data["ids"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("%s is not a note of leases (%s): nothing revoked", path, e)
        return None


def revoke(leases: Leases, timeout_s: float = REVOKE_TIMEOUT_S) -> list[int]:
    """Revoke each lease (blocking); the ids etcd revoked now (not those already
    gone). etcd not answering ends it: the rest would wait as long for nothing."""
    revoked = []
    for lease in leases.ids:
        try:
            # As a string: a lease id needs all 64 bits, more than a JSON number keeps.
            answer = etcd_gateway.call(
                leases.endpoints, "lease/revoke", {"ID": str(lease)}, timeout_s
            )
        except ConnectionError as e:
            # 404: expired, or the bridge revoked it as it ended.
            if isinstance(e, etcd_gateway.EtcdRefused) and e.status == 404:
                log.debug("lease %x was gone already", lease)
                continue
            log.warning("etcd leases not revoked (%s): they expire with their TTL", e)
            break
        if "error" not in answer:
            revoked.append(lease)
    return revoked


class LeasesFile:
    """A supervisor's side: the file a bridge child notes its leases in (in
    ``folder``, private to this user), and their revocation once it has exited."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / FILE_NAME

    def env(self) -> dict[str, str]:
        """What the bridge child's environment gets to note its leases here."""
        return {LEASES_FILE_ENV: os.fspath(self.path)}

    async def revoke(self, exit_code: int) -> None:
        """Revoke the leases the child that exited with ``exit_code`` noted, then
        forget them (the next child notes its own). A bridge that exited 0 ended
        in order and took its records out itself: nothing to revoke."""
        leases = read(self.path)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if leases is None or not leases.ids or exit_code == 0:
            return
        revoked = await asyncio.to_thread(revoke, leases)
        if revoked:
            log.info(
                "revoked the etcd leases of the bridge that exited with %s (%s): "
                "its records are gone",
                exit_code,
                ", ".join(f"{i:x}" for i in revoked),
            )


def note_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The file this bridge notes its leases in, when a supervisor named one."""
    raw = environ.get(LEASES_FILE_ENV)
    return Path(raw) if raw else None
