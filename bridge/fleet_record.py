"""What this worker publishes in discovery for a trainer's fleet refit.

Dynamo registers a model deployment card per worker instance, under its lease;
its runtime config carries an engine's own entries (``runtime_data``). The
bridge puts there, under ``rl_client.fleet_discovery.RUNTIME_DATA_KEY``, what a
trainer needs to refit this worker: its RL admin URL (the system port the bridge
serves) and its engine server's address, so that a trainer lists its fleet from
discovery (``rl_client.fleet_discovery``) instead of a hand-kept list.

The admin URL names a host other machines can reach: the system host when it is
a specific one, else ``BRIDGE_ADVERTISED_HOST``, else the host Dynamo advertises
this worker's request plane on (``DYN_TCP_RPC_HOST``), else this machine's
outbound address (no packet sent), else loopback.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from bridge.admin.system_server import SystemPort
from bridge.config import BridgeConfig
from rl_client.fleet_discovery import RUNTIME_DATA_KEY, worker_runtime_data

_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
# Any address outside this host: a UDP "connect" only picks the outbound interface.
_PROBE = ("10.255.255.255", 1)


def _outbound_ip() -> str | None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(_PROBE)
        ip = str(s.getsockname()[0])
        return None if ip in _WILDCARDS else ip
    return None


def advertised_host(bound: str, env: Mapping[str, str] = os.environ) -> str:
    """The host in this worker's admin URL, for a server bound to ``bound``."""
    if bound not in _WILDCARDS:
        return bound
    for name in ("BRIDGE_ADVERTISED_HOST", "DYN_TCP_RPC_HOST"):
        value = env.get(name, "").strip()
        if value and value not in _WILDCARDS:
            return value
    return _outbound_ip() or "127.0.0.1"


def admin_url(port: SystemPort, env: Mapping[str, str] = os.environ) -> str:
    host = advertised_host(port.host, env)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"http://{host}:{port.port}"


def runtime_data(
    config: BridgeConfig, system: SystemPort | None, env: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """The card's ``runtime_data``: this worker's entry for trainers. ``system``:
    the system port serving the RL admin routes (None: no routes here)."""
    return {
        RUNTIME_DATA_KEY: worker_runtime_data(
            admin_url=admin_url(system, env) if system is not None else None,
            engine_address=config.engine_address,
            engine_tls=config.client.tls is not None,
        )
    }
