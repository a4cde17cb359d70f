"""``python -m bridge``: serve one engine server as a Dynamo worker until SIGTERM.

Dynamo's Rust worker owns the signals: on SIGTERM/SIGINT it unregisters from
discovery, waits its grace period, calls ``BridgeEngine.cleanup()`` and exits.
"""

from __future__ import annotations

import gc
import sys

from dynamo.common.backend.run import run

from bridge.engine import BridgeEngine


def main(argv: list[str] | None = None) -> int:
    # What is loaded now (Dynamo, grpc, their imports) stays for the process's life:
    # spare the collector rescanning it on every full collection.
    gc.collect()
    gc.freeze()
    try:
        run(BridgeEngine, argv)
    except Exception as e:  # start-up failures arrive wrapped by Dynamo's Rust worker
        print(f"bridge: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
