"""KvRelay: the engine server's KV-event stream -> a RouterView -> Dynamo's publisher.

The subscription loop alone: it opens ``SubscribeKvEvents`` where the view
says (a snapshot first, then after its last batch), hands each message to the
view, resubscribes after a gap or a broken stream with a backoff that grows
while nothing applies, and stops for good on UNIMPLEMENTED. No Dynamo import:
the publisher arrives as an object through ``PushSource(on_ready=relay.on_ready)``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from bridge import metrics
from bridge.client import EngineClient
from bridge.kv_view import RouterView, Verdict
from bridge.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class KvRelay:
    """Consumes SubscribeKvEvents from ``client`` into ``view``."""

    def __init__(
        self, client: EngineClient, view: RouterView, *, backoff_s: tuple[float, float] = (0.1, 5.0)
    ) -> None:
        self._client = client
        self.view = view
        view.on_resync = self._request_resync
        self._backoff_s = backoff_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._resync = False

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Start streaming on the running loop (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self._run(), name="kv-relay")

    def on_ready(self, publisher: Any, rank: int = 0) -> None:
        """PushSource callback (one per data-parallel rank); may come from a runtime
        thread, so hop onto our loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.view.set_publisher, publisher, rank)
        else:
            self.view.set_publisher(publisher, rank)

    async def stop(self) -> None:
        """Stop the stream; safe to call twice or without start()."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    # -- stream ------------------------------------------------------------

    def _request_resync(self) -> None:
        self._resync = True
        if self._call is not None:
            self._call.cancel()

    async def _run(self) -> None:
        low, high = self._backoff_s
        delay = low
        view = self.view
        first = True
        while True:
            if not first:
                metrics.KV_RESUBSCRIPTIONS.inc()
            first = False
            request = view.subscription_request()
            call = self._client.subscribe_kv_events(request)
            self._call, self._resync = call, False
            try:
                async for response in call:
                    verdict = view.apply_message(response)
                    if verdict is Verdict.APPLIED:
                        delay = low
                    elif verdict is Verdict.RESYNC:
                        break
                else:
                    log.info("kv relay: the engine server ended the stream; resubscribing")
                # Resubscribe after a pause that grows while nothing applies.
                call.cancel()
                await asyncio.sleep(delay)
                delay = min(delay * 2, high)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._resync or (task is not None and task.cancelling()):
                    raise
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning(
                        "kv relay: engine server has no KV events (%s); relay off", e.details()
                    )
                    return
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    view.reset_position()
                elif not (code == grpc.StatusCode.CANCELLED and self._resync):
                    log.warning(
                        "kv relay: stream failed (%s: %s); retrying in %.1fs",
                        code.name,
                        e.details(),
                        delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, high)
            finally:
                call.cancel()
                self._call = None
