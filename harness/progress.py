"""Progress where people wait (``make run``, ``make bench``): tqdm bars with the
elapsed time, quiet when the output is not a terminal (logs, CI)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


def _interactive() -> bool:
    return sys.stderr.isatty()


@contextmanager
def waiting(what: str, *, interval_s: float = 0.5) -> Iterator[None]:
    """A line ``what ... 12.3s`` that ticks until the block ends (a wait whose
    length nobody knows in advance: an engine starting, a model loading)."""
    bar = tqdm(
        desc=what,
        bar_format="{desc} ... {elapsed}",
        disable=not _interactive(),
        leave=False,
        file=sys.stderr,
    )
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def counting(what: str, total: int, unit: str = "it") -> tqdm:
    """A bar over ``total`` steps with elapsed and remaining time; ``bar.write()``
    prints above it."""
    return tqdm(
        total=total,
        desc=what,
        unit=unit,
        disable=not _interactive(),
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
