"""SIGTERM and SIGINT for a program that stops cleanly on them, then exits 0.

Python-level handlers, not the event loop's: removing a loop's handler (as
closing the loop does) puts the default disposition back before anything else
can be set, and a SIGTERM repeated in that instant (a supervisor repeating it, a
whole process group signalled again) turns the clean exit into death by signal.
Here, once the program has stopped, the handler is swapped for SIG_IGN in one
step: the default disposition never comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_signals(
    loop: asyncio.AbstractEventLoop, on_stop: Callable[[signal.Signals], None]
) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT call ``on_stop(sig)`` on ``loop`` (whose
    thread must be the main one); after it they are ignored: what is left is the
    interpreter's exit."""

    def on_signal(signum: int, _: object) -> None:
        loop.call_soon_threadsafe(on_stop, signal.Signals(signum))

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    with _wake_on_signals(loop):
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)


@contextmanager
def _wake_on_signals(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """A signal may land on any thread (gRPC's, an engine's), and the main thread
    runs a Python handler only once it runs Python again: the loop must wake.
    uvloop listens on a wakeup fd of its own whatever the handlers; asyncio's loop
    only for signals given to it, so it gets one here."""
    if type(loop).__module__.startswith("uvloop"):
        yield
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)

    def drain() -> None:  # the handlers ran as the loop woke
        with contextlib.suppress(BlockingIOError):
            while reader.recv(4096):
                pass

    loop.add_reader(reader.fileno(), drain)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
