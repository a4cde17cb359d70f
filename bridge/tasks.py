"""How the bridge stops a background task it started (a watch, a relay, a loop)."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (None: nothing ran) and return once it has ended, so that
    nothing it does outlives its owner's stop; how it ended is its own to report."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
