"""A bridge started by a host process ends with it, even when the host is SIGKILLed.

``BRIDGE_PARENT_PID`` (set by ``engine_server.host``) names the process whose
death must end this bridge. On Linux the kernel delivers SIGTERM then
(``PR_SET_PDEATHSIG``); everywhere, a watcher thread also notices the parent
gone (re-parented) within half a second. SIGTERM is Dynamo's orderly shutdown:
the worker leaves discovery at once, so the model stops being routed here.
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

log = logging.getLogger(__name__)

ENV = "BRIDGE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    return False


def watch_parent(environ: dict[str, str] | None = None, interval_s: float = 0.5) -> int | None:
    """End this process (SIGTERM) when the parent named in the environment dies;
    the pid watched, or None when none is named."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if not raw:
        return None
    parent = int(raw)
    _set_pdeathsig(signal.SIGTERM)
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
