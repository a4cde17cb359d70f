"""Loopback ports drawn for a program that binds them later (Dynamo's system server,
which the bridge moves to an internal port; the test harness's processes), never
handed out twice on one host within a while.

A port free when drawn stays free only until someone binds it. Two bridges started
at once on one host (a node's workers) could draw one internal port, and the
second's Dynamo would lose it (``SystemServer.check_internal_port`` then refuses to
start); two test processes could hand one port to two programs. So every draw by
this user is recorded in one file in the temp folder, read and written under an
exclusive ``flock``, and a port is not handed out again within ``CLAIM_S``, far
more than any program takes to bind. Where that file cannot be used (a read-only
temp folder), a draw takes what is free, as it did without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

CLAIM_S = 900.0
CLAIMS = Path(tempfile.gettempdir()) / f"rollout-bridge-ports-{os.getuid()}"


def bindable(port: int) -> bool:
    """Whether loopback ``port`` can be bound right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free(ports: range, taken: dict[int, float]) -> int:
    for _ in range(200):
        port = random.choice(ports)
        if port not in taken and bindable(port):
            return port
    raise OSError(f"no free port in [{ports.start}, {ports.stop})")


def _read(f: IO[str]) -> dict[int, float]:
    """The live claims (port: when drawn); a line that does not parse, or whose
    time lies ahead or is older than the window, has lapsed."""
    f.seek(0)
    now = time.time()
    claims: dict[int, float] = {}
    for line in f.read().splitlines():
        with contextlib.suppress(ValueError):
            port, when = line.split()
            if 0 <= now - float(when) < CLAIM_S:
                claims[int(port)] = float(when)
    return claims


def draw(ports: range) -> int:
    """A loopback port in ``ports`` free right now that no draw on this host handed
    out within ``CLAIM_S``; OSError when there is none."""
    try:
        f = open(CLAIMS, "a+", errors="replace")
    except OSError as e:
        log.debug("port claims at %s unusable (%s): drawing unclaimed", CLAIMS, e)
        return _free(ports, {})
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        claims = _read(f)
        port = _free(ports, claims)
        claims[port] = time.time()
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {when}\n" for p, when in claims.items()))
        return port
