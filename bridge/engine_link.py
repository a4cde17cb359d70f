"""EngineLink: the bridge's hold on the one engine server at its address.

That server can restart, be swapped or wedge while the bridge runs, so what the
bridge knows of it (its info and instance, whether it fits what the worker
registered with Dynamo) is kept in one place and updated by one sequence, the
same at start and after every change the watch or the KV stream reports. A
server the worker cannot serve is refused: out of the router's pool, loudly,
until a fitting one is back. A server that lacks the fleet's committed weights
(started, or restarted, mid-training) is held out the same way until it has
them (``bridge.catch_up``): before the worker registers at all, and again after
every restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable

import grpc

from bridge import catch_up, metrics
from bridge.client import EngineClient, IncompatibleServerError, check_compatible
from bridge.config import BridgeConfig
from bridge.engine_watch import EngineWatch
from bridge.registration import Registration
from bridge.swap import unfollowable_changes
from bridge.tasks import cancel_and_wait
from engine_contract.v1 import engine_pb2 as pb
from rl_client.committed import CommittedStore

log = logging.getLogger(__name__)

STREAMED = "multiplexed on a stream"
UNARY = "one call each"


class EngineLink:
    """The client, the server's info and instance, and the transports the flags chose.
    ``start()`` connects; ``note_instance()`` and the watch re-read the server."""

    def __init__(self, config: BridgeConfig, registration: Registration) -> None:
        self.config = config
        self.registration = registration
        self.client: EngineClient | None = None
        self.info: pb.GetServerInfoResponse | None = None
        self.instance_id = ""
        # Why the engine server now at our address cannot be served (registration
        # mismatch), if so: out of the pool until a fitting one is back.
        self.unservable: str | None = None
        # Every server inside the contract's window serves both streams, so the
        # flags alone choose: auto and stream multiplex, unary makes one call each.
        self.stream_rollouts = config.rollout_transport != "unary"
        self.stream_generates = config.generate_transport != "unary"
        # Why the worker stays out of the pool until its engine server serves the
        # fleet's committed weights, while it catches up (None: it may serve).
        self.held: str | None = None
        self._store = (
            catch_up.committed_store_for(
                config.namespace, config.component, config.discovery_backend
            )
            if config.catch_up
            else None
        )
        self._catching_up: asyncio.Task[None] | None = None
        self._registered: pb.GetServerInfoResponse | None = None
        self._watch: EngineWatch | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        self._server_info = metrics.EngineServerCollector(
            lambda: (
                config.engine_address,
                self.instance_id,
                self.info.backend_name if self.info is not None else "",
            )
        )

    @property
    def watch(self) -> EngineWatch | None:
        """The engine server's health watch, once started (the RL sleep and wake
        routes ask it to recheck: ``EngineWatch.recheck``)."""
        return self._watch

    @property
    def committed_store(self) -> CommittedStore | None:
        """Where the fleet's committed record lives, when catch-up reads one (a
        version-guarded rollout's refusal is judged against it:
        ``bridge.weight_refusal``)."""
        return self._store

    @property
    def serving(self) -> bool:
        """False while the server is wedged, gone, refused or catching up: fail
        requests fast (migratable)."""
        watch = self._watch
        return self.unservable is None and self.held is None and (watch is None or watch.serving)

    async def start(
        self, worker_id: int, on_stalled: Callable[[], None]
    ) -> pb.GetServerInfoResponse:
        """Connect, wait for the server, watch its health (``on_stalled``: it stopped
        answering for the stall timeout) and adopt it; raises EngineNotReadyError or
        IncompatibleServerError. Returns the info the worker registers, once its
        engine serves the fleet's committed weights (``bridge.catch_up``)."""
        cfg = self.config
        metrics.REGISTRY.register(self._server_info)
        log.info(
            "worker %s: connecting to engine server at %s (waiting up to %.0fs)",
            worker_id,
            cfg.engine_address,
            cfg.connect_timeout_s,
        )
        self.client = EngineClient(cfg.engine_address, cfg.client)
        info = await self.client.wait_ready(cfg.connect_timeout_s)
        self._watch = EngineWatch(
            self.client,
            self._engine_changed,
            interval_s=cfg.watch_interval_s,
            stall_timeout_s=cfg.stall_timeout_s,
            on_stalled=on_stalled,
            gone_after_s=cfg.exit_after_engine_gone_s,
            on_gone=self._engine_gone,
        )
        self._watch.start()
        self._adopt(self.client, info)
        self._registered = info  # what Dynamo is told; a replacement must fit it
        ec = info.engine_config
        rollouts, completions = self._transports()
        log.info(
            "engine server %s ready: %s (%s %s, contract %d), context %d, block size %d, "
            "rollouts %s, completions %s",
            info.instance_id,
            info.model_name,
            info.backend_name,
            info.backend_version,
            info.contract_revision,
            ec.context_length,
            ec.kv_block_size,
            rollouts,
            completions,
        )
        if self._store is not None:
            self._begin_catch_up()
            await self._caught_up()
        return info

    def _adopt(self, client: EngineClient, info: pb.GetServerInfoResponse) -> None:
        """Serve ``info``'s server (``check_compatible`` passed it): its instance and
        its limits."""
        self.info, self.instance_id = info, info.instance_id
        client.use_server_limits(info)

    def _transports(self) -> tuple[str, str]:
        """How rollouts and completions travel, for the log."""
        paced = self.client is not None and self.client.paced_generates
        completions = (STREAMED + (", paced" if paced else "")) if self.stream_generates else UNARY
        return (STREAMED if self.stream_rollouts else UNARY), completions

    def note_instance(self, instance_id: str) -> None:
        """Another instance answered (the KV stream, a rollout): re-read what it is (at
        once: a fast restart may never fail a health probe)."""
        if instance_id != self.instance_id:
            log.info("engine server restarted: instance %s -> %s", self.instance_id, instance_id)
            self.instance_id = instance_id
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self._follow_restart())

    async def _follow_restart(self) -> None:
        if not await self._refresh_info():
            await self._out_until_known("restarted")

    async def _out_until_known(self, why: str) -> None:
        """The engine server answers health but not (yet) its info: which instance
        serves, and whether it must catch up first, is not known. Out of the pool
        until the next probe's SERVING answer tells again (and its info is read)."""
        await self.registration.leave(f"the engine server {why}; its info not read yet")
        if self._watch is not None:
            self._watch.recheck()

    async def _engine_changed(self, serving: bool, reason: str) -> None:
        if serving:
            metrics.RECONNECTS.inc()
            # Maybe another instance: adapt, or stay out.
            if not await self._refresh_info():
                await self._out_until_known("serves again")
                return
            if self.unservable is None and self.held is None:
                await self.registration.rejoin(reason)
        else:
            await self.registration.leave(reason)

    async def _refresh_info(self) -> bool:
        """Re-read the engine server's info; adapt to a new instance, or leave the
        pool (loudly) when Dynamo's registration cannot follow what changed. False:
        the server did not answer."""
        async with self._refresh_lock:  # the watch and the KV relay may both ask
            return await self._refresh()

    async def _refresh(self) -> bool:
        client, old, registered = self.client, self.info, self._registered
        if client is None or old is None or registered is None:
            return True
        was_unservable = self.unservable is not None
        try:
            info = await client.server_info()
            check_compatible(info, client.address)
            if info.instance_id == old.instance_id and not was_unservable:
                return True
            changes = unfollowable_changes(
                registered,
                info,
                name_pinned=bool(self.config.served_model_name),
                kv_routing=self.config.kv_events,
            )
            if changes:
                raise IncompatibleServerError(
                    f"the engine server at {client.address} (instance {info.instance_id}) "
                    f"differs from what this worker registered: {'; '.join(changes)}. Dynamo "
                    "cannot follow that; restart the bridge to register it"
                )
            self._adopt(client, info)
            if info.instance_id != old.instance_id:
                self._begin_catch_up()  # a restarted engine serves its start weights
        except grpc.aio.AioRpcError:
            return False  # not answering (yet)
        except IncompatibleServerError as e:
            await self._refuse(str(e))
            return True
        self.unservable = None
        metrics.INSTANCE_CHANGES.inc()
        rollouts, completions = self._transports()
        log.info(
            "engine server replaced: instance %s -> %s (%s %s, contract %d, rollouts %s, "
            "completions %s)",
            old.instance_id,
            info.instance_id,
            info.backend_name,
            info.backend_version,
            info.contract_revision,
            rollouts,
            completions,
        )
        if was_unservable and self.serving:
            # Back in the pool now: a quick swap may never fail a health probe, so
            # the watch would not tell.
            await self.registration.rejoin(f"a fitting engine server is back at {client.address}")
        return True

    # -- catch-up before serving ---------------------------------------------------

    def _begin_catch_up(self) -> None:
        """Hold the worker out of the pool until the engine server now at our address
        serves the committed weights; a catch-up for an earlier instance gives way."""
        store, client = self._store, self.client
        if store is None or client is None:
            return
        previous = self._catching_up
        if previous is not None:
            previous.cancel()
        self.held = "catching up with the fleet's committed weights"
        metrics.CATCHING_UP.set(1)
        self._catching_up = asyncio.ensure_future(self._catch_up(store, client, previous))

    async def _catch_up(
        self,
        store: CommittedStore,
        client: EngineClient,
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None:  # its last call ends before ours starts
            await asyncio.gather(previous, return_exceptions=True)
        gate = catch_up.CatchUp(
            store, client.refit, control_timeout_s=self.config.client.control_timeout_s
        )

        async def hold(why: str) -> None:
            await self.registration.leave(f"catching up: {why}")

        result = await gate.run(on_hold=hold)
        self.held = None
        metrics.CATCHING_UP.set(0)
        catch_up.observe(result)
        if self.serving:
            # Shielded: a newer catch-up's leave must find the pool as this left it.
            await asyncio.shield(
                self.registration.rejoin(
                    f"the engine server serves the committed weights {result.version!r}"
                )
            )

    async def _caught_up(self) -> None:
        """Until the current catch-up has finished (a newer one replaces it when the
        engine server restarts meanwhile); raises what it raised."""
        while (task := self._catching_up) is not None:
            await asyncio.wait({task})
            if self._catching_up in (task, None):
                task.result()
                return

    async def _refuse(self, why: str) -> None:
        if self.unservable != why:
            log.error("%s; out of the router's pool", why)
        self.unservable = why
        await self.registration.leave(why)

    def _engine_gone(self) -> None:
        log.error(
            "engine server at %s unreachable for %.0fs: exiting (--exit-after-engine-gone-s)",
            self.config.engine_address,
            self.config.exit_after_engine_gone_s or 0,
        )
        os.kill(os.getpid(), signal.SIGTERM)  # Dynamo's orderly shutdown: leave discovery

    async def stop_following(self) -> None:
        """No more re-reads or health reactions (the worker is shutting down)."""
        with contextlib.suppress(KeyError):
            metrics.REGISTRY.unregister(self._server_info)
        for task in (self._refreshing, self._catching_up):
            await cancel_and_wait(task)
        self._refreshing = self._catching_up = None
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.stop()

    async def close(self) -> None:
        """Close the channel (after ``stop_following``); idempotent."""
        client, self.client = self.client, None
        if client is not None:
            await client.close()
