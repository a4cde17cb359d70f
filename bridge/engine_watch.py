"""EngineWatch: is the engine server serving right now? Asked every fraction of a second.

A dead engine server fails calls at once, but a wedged one (SIGSTOPped, a host
that stalls) accepts connections and answers nothing: requests would hang
until TCP keepalive gave up. The watch asks gRPC health with a short deadline
and says when the answer changes, so that the bridge fails new requests fast
with a retryable error and leaves the router's pool while the engine cannot
serve, and comes back when it answers again. Requests still waiting on an
engine server that stays unresponsive past ``stall_timeout_s`` are failed
(retryable), so that none hangs for good.

It reports changes it sees, and an outage shorter than its ``failures`` probes
(a sleep and a wake within half a second) it never sees. Whoever takes the
worker out of the pool on the engine's behalf (the RL ``control/sleep`` route)
therefore calls ``recheck()``: the next SERVING answer is reported as serving
again however the engine came back (woken over the route, over gRPC, by
anyone), so that the worker rejoins the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from bridge.client import EngineClient, Health
from bridge.tasks import cancel_and_wait

log = logging.getLogger(__name__)

OnChange = Callable[[bool, str], Awaitable[None]]


class EngineWatch:
    def __init__(
        self,
        client: EngineClient,
        on_change: OnChange,
        *,
        interval_s: float = 0.25,
        failures: int = 2,
        stall_timeout_s: float | None = 10.0,
        on_stalled: Callable[[], None] | None = None,
        gone_after_s: float | None = None,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._on_change = on_change
        self.interval_s = interval_s
        self.failures = failures
        self.stall_timeout_s = stall_timeout_s
        self._on_stalled = on_stalled
        self.gone_after_s = gone_after_s
        self._on_gone = on_gone
        self.serving = True
        self.down_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        # recheck() marks made, the last one a SERVING answer was reported for, and
        # the last one whose probe round has finished (checked() waits on it).
        self._marks = 0
        self._retold = 0
        self._checked = 0
        self._round_done = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def recheck(self) -> int:
        """The owner left the pool itself (its engine goes to sleep) or finds itself
        out of it while its engine serves: report the next SERVING answer as serving
        again even if this watch saw no outage (the owner re-reads the server and
        rejoins). Only probes started after this call count. Returns the mark for
        ``checked``."""
        self._marks += 1
        return self._marks

    async def checked(self, mark: int) -> None:
        """Until a probe started after ``recheck()`` returned ``mark`` has been
        answered and reacted to (or the watch has stopped)."""
        while self._checked < mark and self._task is not None and not self._task.done():
            await self._round_done.wait()

    def _round_finished(self, mark: int) -> None:
        self._checked = max(self._checked, mark)
        done, self._round_done = self._round_done, asyncio.Event()
        done.set()

    async def _run(self) -> None:
        try:
            await self._probe_loop()
        finally:
            self._round_finished(self._marks)  # nobody waits on a watch that ended

    async def _probe_loop(self) -> None:
        failed = 0
        stall_reported = False
        unreachable_since: float | None = None
        while True:
            started = time.monotonic()
            mark = self._marks  # the rechecks this answer can settle
            health = await self._client.health()
            now = time.monotonic()
            ok = health is Health.SERVING
            # "Gone" counts only silence: a server that answers NOT_SERVING (asleep,
            # draining, starting) is there.
            if health is Health.UNREACHABLE:
                unreachable_since = unreachable_since or now
            else:
                unreachable_since = None
            if ok:
                failed = 0
                stall_reported = False
                if not self.serving:
                    down = now - (self.down_since or now)
                    self.serving, self.down_since = True, None
                    self._retold = mark
                    await self._tell(True, f"engine server serving again after {down:.1f}s")
                elif self._retold < mark:
                    self._retold = mark
                    await self._tell(True, "engine server serving (rechecked: out of the pool)")
            else:
                failed += 1
                if self.serving and failed >= self.failures:
                    self.serving, self.down_since = False, now
                    await self._tell(False, f"engine server {health.value}")
                if (
                    not self.serving
                    and not stall_reported
                    and self.stall_timeout_s is not None
                    and self.down_since is not None
                    and now - self.down_since >= self.stall_timeout_s
                    and self._on_stalled is not None
                ):
                    stall_reported = True
                    self._on_stalled()
                if (
                    self.gone_after_s is not None
                    and self._on_gone is not None
                    and unreachable_since is not None
                    and now - unreachable_since >= self.gone_after_s
                ):
                    self._on_gone()
                    return
            self._round_finished(mark)
            await asyncio.sleep(max(0.0, self.interval_s - (now - started)))

    async def _tell(self, serving: bool, reason: str) -> None:
        """The owner's reaction (leave or rejoin the pool); its failure is logged,
        never the end of the watch."""
        try:
            await self._on_change(serving, reason)
        except Exception:
            log.exception("reacting to the engine server's state (%s) failed", reason)
