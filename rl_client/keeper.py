"""The trainer's keeper: engine servers that restart come back on the committed weights.

A fleet refit (``rl_client.fleet_cycle``) moves every engine server it reaches to the
new version. One that restarts afterwards serves its start checkpoint (label
"default"; paused, with ``--start-paused``), and its bridge keeps it out of the
router's pool until it serves the fleet's committed weights
(``bridge/catch_up.py``). A committed checkpoint the bridge loads itself;
weights the trainer pushed (streamed from its memory, on no disk) only the
trainer can send again. That is this keeper's job: it asks every engine server
for its weight version (a bounded poll, on channels of its own) and pushes the
committed weights to one that lags with ``EngineRefitClient.restore`` (one on
another version, or on weights an update left part old, part new when it ended
unfinished: ``weights_mixed``, contract revision 12; one with an update open is
left to that update's writer), under
the same lock as the step's refits, so that a push never interleaves with one
and is checked again after a refit that ran meanwhile.

    async with EngineRefitClient(addresses, store=committed_store("rl")) as trainer:
        keeper = WeightKeeper(trainer)
        keeper.start()
        ...  # each step: await trainer.refit(str(step), tensors=...)
        await keeper.close()

No Dynamo import: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from rl_client.refit import EngineRefitClient
from rl_client.refit_rpc import RefitRpc
from rl_client.tls import TlsOptions, aio_channel

log = logging.getLogger(__name__)

# A probe channel's own connection (not the refit client's: probing an engine that
# is down must not put that one in gRPC's reconnect backoff, up to 120 s), which
# tries again within half a second of a restarted engine listening.
_PROBE_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def _probe(address: str, tls: TlsOptions | None, timeout_s: float) -> RefitRpc:
    options = [*(tls.channel_options() if tls else []), *_PROBE_OPTIONS]
    channel = aio_channel(address, tls, options)
    return RefitRpc(pb_grpc.EngineServiceStub(channel), timeout_s=timeout_s, channel=channel)


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__


class WeightKeeper:
    """Keeps ``client``'s engine servers on its committed weights (see the module
    docs). ``interval_s``: how often each is asked its version (``probe_timeout_s``
    each); ``tls``: as the client's. ``mode``: the pause before a push (what a
    lagging engine runs, it runs on weights the fleet left behind). Open it inside
    the event loop that uses it."""

    def __init__(
        self,
        client: EngineRefitClient,
        *,
        interval_s: float = 0.25,
        probe_timeout_s: float = 1.0,
        tls: TlsOptions | None = None,
        mode: str = "abort",
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.client = client
        self.interval_s = interval_s
        self.mode = mode
        self._probes = {
            address: _probe(address, tls, probe_timeout_s) for address in client.engines
        }
        # Pushes made, the last one's seconds, and each engine's last failure.
        self.pushes = 0
        self.last_push_s: float | None = None
        self.errors: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="weight-keeper")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(probe.close() for probe in self._probes.values()))

    async def check(self) -> list[str]:
        """One look at every engine server; the ones given the committed weights."""
        committed = self.client.committed
        if committed is None or not committed.resendable:
            return []  # nothing committed yet, or nothing this trainer can send
        lagging = await asyncio.gather(
            *(self._lags(address, committed.version) for address in self._probes)
        )
        behind = [a for a, lags in zip(self._probes, lagging, strict=True) if lags]
        pushed = await asyncio.gather(*(self._push(address) for address in behind))
        return [address for address in pushed if address is not None]

    async def _lags(self, address: str, version: str) -> bool:
        try:
            serving = await self._probes[address].get_weight_version()
        except grpc.aio.AioRpcError:
            return False  # down, or starting: asked again on the next tick
        if serving.weight_update_open:
            return False  # a writer's update is open: left to it (restore refuses)
        current = serving.declared and serving.weight_version == version
        return not current or bool(serving.weights_mixed)

    async def _push(self, address: str) -> str | None:
        started = time.monotonic()
        try:
            restored = await self.client.restore(address, mode=self.mode)
        except Exception as e:  # gone again, or refused: tried again on the next tick
            why = _why(e)
            if self.errors.get(address) != why:
                log.warning("pushing the committed weights to %s failed: %s", address, why)
            self.errors[address] = why
            return None
        self.errors.pop(address, None)
        if not restored:
            return None
        seconds = time.monotonic() - started
        self.pushes += 1
        self.last_push_s = seconds
        committed = self.client.committed
        log.warning(
            "engine server %s lagged the fleet (restarted?): pushed the committed weights %r "
            "in %.3fs",
            address,
            committed.version if committed is not None else None,
            seconds,
        )
        return address

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check()
            except Exception:  # a bug, not a lagging engine: say so, keep watching
                log.exception("the weight keeper's check failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
