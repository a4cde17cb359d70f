"""Helpers for the vLLM-level tests (importable: this folder is on sys.path)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(predicate: Callable[[], bool], within_s: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


async def settle(count: Callable[[], int], quiet_s: float = 0.2, within_s: float = 5.0) -> None:
    """Wait until ``count()`` (e.g. KV batches received) stops changing for ``quiet_s``."""
    deadline = time.monotonic() + within_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
