"""Children that end with their parent, even when the parent is SIGKILLed.

On Linux the kernel sends a child SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), once armed, in one of two ways:

- by the parent, between fork and exec (``death_signal_setter``): only from a
  parent with no other threads, since a fork of a threaded process may deadlock
  before the exec (``engine_worker``'s launcher);
- by the child itself, told its parent's pid in ``PARENT_PID_ENV``
  (``watch_parent``), which also polls for the parent gone (re-parented) every
  half second: what a host process full of threads uses (``engine_server.host``,
  a Ray actor), and a second watch under the launcher.

SIGTERM is then each program's orderly exit (the bridge leaves Dynamo's
discovery at once, so the model stops being routed to it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# The pid of the process whose death must end this one (the bridge reads it).
PARENT_PID_ENV = "BRIDGE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


def death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` arming SIGTERM on the parent's death (Linux), or None.
    libc is loaded here, in the parent: the forked child only calls it."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def with_parent_pid(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` naming this process as the parent a child must end with."""
    return {**environ, PARENT_PID_ENV: str(os.getpid())}


def watch_parent(environ: Mapping[str, str] | None = None, interval_s: float = 0.5) -> int | None:
    """End this process (SIGTERM) when the parent named in the environment dies;
    the pid watched, or None when none is named."""
    raw = (os.environ if environ is None else environ).get(PARENT_PID_ENV)
    if not raw:
        return None
    parent = int(raw)
    prctl = _prctl()
    if prctl is not None:
        with contextlib.suppress(OSError):
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # died before the death signal was armed
        log.error("parent process %d is gone: exiting", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        return parent

    def poll() -> None:
        stop = threading.Event()
        while not stop.wait(interval_s):
            if os.getppid() != parent:
                log.error("parent process %d died: shutting down", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()
    return parent
