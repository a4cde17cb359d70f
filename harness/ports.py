"""Free TCP ports on loopback, for programs that cannot report the port they bound."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Where listening ports are drawn from: above Linux's default ephemeral range
# (32768-60999), from which every outgoing connection's source port and every
# OS-assigned listener (Dynamo's request plane, say) is taken. A port drawn there
# could be taken by any of them before its program binds it: a frontend once
# failed to start so, its port the source port of a connection somewhere else.
LISTEN_PORTS = range(61000, 65536)

# Workers' system ports, below 32768 (Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an
# i16) and apart from where bridges draw their internal one
# (``bridge.admin.system_server.INTERNAL_PORTS``), so that a bridge started first
# never draws the port a later worker of the same test is given.
SYSTEM_PORTS = range(10000, 20000)

# A port free when drawn stays free until its program binds it, seconds later; a
# draw in another test process (an xdist worker, the low end's run beside the main
# one) or later in the same test could hand it out again in between (seen: two
# bridges of one run given one system port, the second refused its bind). Every
# draw by this user is recorded here (one file in the temp folder, which the
# runs of one ``make test`` share), and no port is handed out twice within this
# long, far more than any program takes to bind.
_CLAIM_S = 900.0
_CLAIMS = Path(tempfile.gettempdir()) / f"rollout-bridge-test-ports-{os.getuid()}"


@contextlib.contextmanager
def _claims() -> Iterator[dict[int, float]]:
    """The live claims (port: when drawn), under a machine-wide lock; what the
    caller adds is written back."""
    with open(_CLAIMS, "a+", errors="replace") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now = time.time()
        claims: dict[int, float] = {}
        for line in f.read().splitlines():  # what does not parse, or lies ahead, lapses
            with contextlib.suppress(ValueError):
                port, when = line.split()
                if 0 <= now - float(when) < _CLAIM_S:
                    claims[int(port)] = float(when)
        yield claims
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port} {when}\n" for port, when in claims.items()))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _draw(ports: range) -> int:
    """A port in ``ports`` free right now that no recent draw handed out."""
    with _claims() as claims:
        for _ in range(200):
            port = random.choice(ports)
            if port not in claims and _bindable(port):
                claims[port] = time.time()
                return port
    raise OSError(f"no free port in [{ports.start}, {ports.stop})")


def _ephemeral_ports() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(int(low), int(high) + 1)


def free_port() -> int:
    """A loopback port free right now, above the ephemeral range where the machine
    leaves room (else an OS-assigned one): no other draw hands it out before you
    bind it."""
    ports = range(max(LISTEN_PORTS.start, _ephemeral_ports().stop), LISTEN_PORTS.stop)
    if ports:
        with contextlib.suppress(OSError):
            return _draw(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_system_port() -> int:
    """A port for a worker's system server, free right now."""
    from bridge.admin.system_server import INTERNAL_PORTS

    assert SYSTEM_PORTS.stop <= INTERNAL_PORTS.start
    return _draw(SYSTEM_PORTS)
