"""``python -m bridge``: serve one engine server as a Dynamo worker until SIGTERM.

Dynamo's Rust worker owns the signals: on SIGTERM/SIGINT it unregisters from
discovery, waits its grace period, calls ``BridgeEngine.cleanup()`` and exits.

With etcd discovery, Dynamo 1.6.1's runtime also shuts itself down, quietly and
with exit 0, when its etcd lease expires (the bridge was stopped or cut off
longer than ``ETCD_LEASE_TTL``): the worker would be gone for good although it
can serve again. So a bridge that ended without being asked to starts itself
afresh (same process id, same arguments, a new lease and instance id).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from types import FrameType

from dynamo.common.backend.worker import WorkerConfig

from bridge.dynamo_compat import run_worker
from bridge.engine import BridgeEngine
from launch.parent_death import watch_parent

log = logging.getLogger("bridge")
# Signals that asked this process to end (seen ahead of the Rust worker's own
# handlers, which call the handler installed before theirs).
_asked_to_end: list[int] = []
# The bridge, once made: told at once, so that nothing puts the worker back in
# discovery while Dynamo's worker drains it.
_engines: list[BridgeEngine] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _asked_to_end.append(signum)
    for engine in _engines:
        engine.registration.end()


def _restart_after_lost_lease(discovery_backend: str, argv: list[str]) -> None:
    """Replace this process with a fresh bridge when the runtime ended by itself."""
    if discovery_backend != "etcd" or _asked_to_end:
        return
    if os.environ.get("BRIDGE_RESTART_ON_LOST_LEASE", "1") == "0":
        return
    log.warning(
        "Dynamo's runtime shut down without being asked (its etcd lease expired: this "
        "bridge was unresponsive past ETCD_LEASE_TTL); starting afresh to register again"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "bridge", *argv])


def main(argv: list[str] | None = None) -> int:
    # What is loaded now (Dynamo, grpc, their imports) stays for the process's life:
    # spare the collector rescanning it on every full collection.
    gc.collect()
    gc.freeze()
    watch_parent()  # started by a supervisor that names itself: end with it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember)

    async def factory(args: list[str] | None) -> tuple[BridgeEngine, WorkerConfig]:
        engine, worker_config = await BridgeEngine.from_args(args)
        _engines.append(engine)
        if _asked_to_end:  # asked while it was being made
            engine.registration.end()
        return engine, worker_config

    try:
        run_worker(BridgeEngine, argv, factory)
    except Exception as e:  # start-up failures arrive wrapped by Dynamo's Rust worker
        print(f"bridge: {e}", file=sys.stderr)
        return 1
    if _engines and _engines[0].exit_code == 0:
        _restart_after_lost_lease(
            _engines[0].config.discovery_backend, sys.argv[1:] if argv is None else argv
        )
    # Non-zero when the bridge gave up its registration (a supervisor restarts it).
    return _engines[0].exit_code if _engines else 0


if __name__ == "__main__":
    sys.exit(main())
