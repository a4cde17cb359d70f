"""Keeps this worker in Dynamo's discovery exactly while it can serve.

Two jobs, one owner, so they never fight:

- **Follow the engine.** ``leave()`` takes the worker out of the router's pool
  (``Endpoint.unregister_endpoint_instance``) while its engine server cannot
  serve (gone, wedged, draining, asleep); ``rejoin()`` puts it back. The model
  card stays registered meanwhile (the frontend lists the model while any
  worker of it is in the pool).
- **Heal a lost registration.** Discovery can drop a live worker: with file
  discovery, a worker paused (SIGSTOP, a stalled host) for longer than the
  store's 10 s TTL has its files deleted by the frontend, and Dynamo 1.6.1's
  runtime never writes them again (it logs "keep_alive failed" forever). The
  keeper notices (the instance file gone while the worker should be in the
  pool) and writes back the files this worker had published (instance, model
  card, KV-event channels), byte for byte, as Dynamo's own store writes them:
  serving and KV-aware routing resume at once. On other discovery backends
  (etcd: the runtime shuts itself down when its lease is lost), a registration
  that stays missing makes the bridge exit with ``EXIT_REGISTRATION_LOST`` so
  that its supervisor starts a fresh one; so does a worker whose records were
  dropped before the keeper could keep them (stalled during its start-up).
  The records kept must hold the served endpoint's own instance: the worker's
  other endpoint (the KV router's query source) registers first, and records
  kept without it were written back without it.

Asked to end (SIGTERM, SIGINT: ``end()``), Dynamo's worker takes the endpoint
out of discovery and serves on through its grace period and drain; from then on
nothing here puts it back (it was "healed" back into the router's pool while it
drained).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from bridge.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# EX_TEMPFAIL: try again (a supervisor restarts the bridge).
EXIT_REGISTRATION_LOST = 75
# How the log says the records are kept (from then on they can be written back).
RECORDS_KEPT = "registration kept"
# What Dynamo 1.6.1's file store keeps this worker's records under (v1/...).
_FILE_BUCKETS = ("instances", "mdc", "event_channels")


def file_store_root() -> Path:
    """Where Dynamo's file discovery keeps its records (``DYN_FILE_KV``)."""
    root = os.environ.get("DYN_FILE_KV")
    if root:
        return Path(root)
    return Path(os.environ.get("TMPDIR", "/tmp")) / "dynamo_store_kv"


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (Linux): they name our KV-event channels."""
    inodes: set[str] = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class FileRecords:
    """This worker's records in the file store, kept so they can be written back."""

    def __init__(self, root: Path, worker_id: int, endpoint_path: str = "") -> None:
        self.root = root / "v1"
        self.suffix = f"%2F{worker_id:x}"
        # The served endpoint's instance, as its file's name reads unquoted
        # ("<namespace>/<component>/<endpoint>/<id in hex>"); "": any instance.
        self.served = f"{endpoint_path}/{worker_id:x}" if endpoint_path else ""
        self.saved: dict[Path, bytes] = {}

    @property
    def instance_files(self) -> list[Path]:
        return [p for p in self.saved if p.parent.name == "instances"]

    def capture(self) -> bool:
        """Remember our records; False while the registration is not complete yet."""
        ports = {str(p) for p in _listening_ports()}
        saved: dict[Path, bytes] = {}
        for bucket in _FILE_BUCKETS:
            folder = self.root / bucket
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith(".") or not path.is_file():
                    continue
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                ours = path.name.endswith(self.suffix)
                if bucket == "event_channels":
                    # Named by publisher, not worker: ours carry a port we listen on.
                    text = data.decode(errors="replace")
                    ours = any(f':{port}"' in text or f":{port}/" in text for port in ports)
                if ours:
                    saved[path] = data
        instances = [unquote(p.name) for p in saved if p.parent.name == "instances"]
        if self.served and self.served not in instances:
            return False
        if not instances or not any(p.parent.name == "mdc" for p in saved):
            return False
        self.saved = saved
        return True

    def present(self) -> bool:
        return all(p.exists() for p in self.instance_files)

    def restore(self, *, with_instance: bool) -> int:
        """Write back what is missing (atomically, as the store itself writes)."""
        written = 0
        for path, data in self.saved.items():
            if path.exists() or (path.parent.name == "instances" and not with_instance):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tmp_{path.name}"
            tmp.write_bytes(data)
            os.replace(tmp, path)
            written += 1
        return written


class Registration:
    """See the module docs. ``start(endpoint, worker_id)`` once the worker serves."""

    def __init__(
        self,
        discovery_backend: str,
        *,
        endpoint_path: str = "",
        interval_s: float = 0.5,
        lost_after_s: float = 10.0,
        capture_timeout_s: float = 20.0,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.discovery_backend = discovery_backend
        # "<namespace>/<component>/<endpoint>" served ("": not known).
        self.endpoint_path = endpoint_path
        self.interval_s = interval_s
        self.lost_after_s = lost_after_s
        self.capture_timeout_s = capture_timeout_s
        self._on_lost = on_lost
        self._endpoint: Any = None
        self._worker_id = 0
        self._records: FileRecords | None = None
        self._client: Any = None
        self.in_pool = True  # what we want: follow the engine's health
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.heals = 0
        self.lost = False
        self.ending = False

    def start(self, endpoint: Any, worker_id: int) -> None:
        self._endpoint = endpoint
        self._worker_id = worker_id
        if self.discovery_backend == "file":
            self._records = FileRecords(file_store_root(), worker_id, self.endpoint_path)
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="registration")
        if not self.in_pool:  # asked to leave before the endpoint existed
            self.in_pool = True
            asyncio.get_running_loop().create_task(self.leave("the engine server is not serving"))

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def end(self) -> None:
        """The process was asked to end: Dynamo takes the worker out of discovery to
        drain it, and it stays out (no healing, no rejoining). Safe from a signal
        handler."""
        self.ending = True

    async def leave(self, reason: str) -> None:
        """Out of the router's pool (the model card stays registered; the frontend
        lists the model again as soon as a worker of it serves)."""
        async with self._lock:
            if not self.in_pool:
                return
            self.in_pool = False
            if self._endpoint is None:
                return
            try:
                await self._endpoint.unregister_endpoint_instance()
                log.warning("left the router's pool: %s", reason)
            except Exception as e:  # already gone from discovery: the same outcome
                log.warning("left the router's pool (%s); discovery said: %s", reason, e)

    async def rejoin(self, reason: str) -> None:
        async with self._lock:
            if self.in_pool:
                return
            if self.ending:
                log.info("not back in the router's pool (%s): this worker is ending", reason)
                return
            if self._endpoint is not None:
                # In the pool only once discovery took it (a failure is tried again
                # with the next change, and the watch goes on).
                await self._endpoint.register_endpoint_instance()
                log.info("back in the router's pool: %s", reason)
            self.in_pool = True

    # -- healing -----------------------------------------------------------

    async def _present(self) -> bool:
        if self._records is not None:
            return self._records.present()
        if self._client is None:  # one client, kept: it follows discovery itself
            self._client = await self._endpoint.client()
        return self._worker_id in self._client.instance_ids()

    def _lose(self) -> None:
        """Give up on this registration, whichever way it was lost (records never
        captured, or gone past ``lost_after_s``): the owner exits for a restart."""
        self.lost = True
        if self._on_lost is not None:
            self._on_lost()

    async def _watch(self) -> None:
        records = self._records
        # Polled: the Worker writes its records with no event to wait on. Records
        # dropped before they could be kept (the worker stalled during its start)
        # cannot be written back: then exit for a restart, and say why.
        started = time.monotonic()
        while records is not None and not records.capture():
            if self.ending:
                return
            if not self.in_pool:  # out of the pool, the served instance is not there
                started = time.monotonic()
            elif time.monotonic() - started > self.capture_timeout_s:
                log.error(
                    "this worker's discovery records were not all there within %.0fs of "
                    "serving (dropped while it stalled starting up?): they cannot be "
                    "written back; exiting with %d so that a supervisor restarts the bridge",
                    self.capture_timeout_s,
                    EXIT_REGISTRATION_LOST,
                )
                self._lose()
                return
            await asyncio.sleep(self.interval_s)
        if records is not None:
            log.info(
                "%s: this worker's %d discovery records, written back if discovery drops them",
                RECORDS_KEPT,
                len(records.saved),
            )
        missing_since: float | None = None
        while True:
            await asyncio.sleep(self.interval_s)
            async with self._lock:
                if self.ending:
                    return
                if not self.in_pool or await self._present():
                    if missing_since is not None and self.in_pool:
                        log.info("registration is back")
                    missing_since = None
                    continue
                now = time.monotonic()
                if missing_since is None:
                    missing_since = now
                    log.warning("this worker is no longer registered in discovery; healing")
                if records is not None:
                    written = records.restore(with_instance=True)
                    self.heals += 1
                    log.warning(
                        "re-registered: wrote back %d discovery records (%s) after they were "
                        "dropped (the worker was unresponsive past the store's TTL)",
                        written,
                        ", ".join(sorted({p.parent.name for p in records.saved})),
                    )
                    continue
                try:
                    await self._endpoint.register_endpoint_instance()
                except Exception as e:
                    log.warning("re-registering failed: %s", e)
                if now - missing_since >= self.lost_after_s:
                    log.error(
                        "registration lost for %.0fs and not recoverable in this process "
                        "(%s discovery): exiting with %d so that a supervisor restarts the bridge",
                        now - missing_since,
                        self.discovery_backend,
                        EXIT_REGISTRATION_LOST,
                    )
                    self._lose()
                    return
