"""``python -m bridge``: serve one engine server as a Dynamo worker until SIGTERM.

Dynamo's Rust worker owns the signals: on SIGTERM/SIGINT it unregisters from
discovery, waits its grace period, calls ``BridgeEngine.cleanup()`` and exits.
"""

from __future__ import annotations

import gc
import sys

from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig

from bridge.engine import BridgeEngine
from bridge.parent import watch_parent


def main(argv: list[str] | None = None) -> int:
    # What is loaded now (Dynamo, grpc, their imports) stays for the process's life:
    # spare the collector rescanning it on every full collection.
    gc.collect()
    gc.freeze()
    watch_parent()  # started by a host (engine_server.host): end with it
    engines: list[BridgeEngine] = []

    async def factory(args: list[str] | None) -> tuple[BridgeEngine, WorkerConfig]:
        engine, worker_config = await BridgeEngine.from_args(args)
        engines.append(engine)
        return engine, worker_config

    try:
        run(BridgeEngine, argv, engine_factory=factory)
    except Exception as e:  # start-up failures arrive wrapped by Dynamo's Rust worker
        print(f"bridge: {e}", file=sys.stderr)
        return 1
    # Non-zero when the bridge gave up its registration (a supervisor restarts it).
    return engines[0].exit_code if engines else 0


if __name__ == "__main__":
    sys.exit(main())
