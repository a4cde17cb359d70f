"""What an engine server's refusal of a version-guarded rollout means for the fleet.

An engine server refuses a rollout that requires a weight version other than the
one it serves (contract revision 8: ABORTED, ``required_weight_version: ...``).
Passed on as a migratable failure, the frontend tries other workers and, once its
migrations are spent, answers HTTP 503 "Service temporarily unavailable" (Dynamo
1.6.1) or 500 "Failed to fold completions stream" (1.3.0.post1): no frontend keeps
a worker's words. The driver then retries it as any 503, however hopeless.

With the fleet's committed record at hand (``rl_client.committed``, the store
catch-up reads: ``EngineLink.committed_store``) the bridge judges the refusal
(``judge``) on the engine's refit state read after it and the record read after
that. Labels are names, not numbers, so no rule says one is older than another;
what the bridge can tell is whether the fleet could still bring the version:

- **stale**: the engine serves the committed version (a declared label), it is
  neither paused nor asleep nor taking a weight-transfer update, and the rollout
  requires another. Every refit (``rl_client.fleet_cycle``) pauses the workers
  before it changes a label and publishes the record before it resumes them, and
  a trainer's own update runs open (``weight_update_open``, contract revision 12:
  NeMo RL's run unpaused), so such a worker sees no refit under way: the version
  required is an earlier commit's, a refit's that never committed, or one nobody
  made, and no worker in the pool serves it (catch-up keeps workers off the
  committed weights out of it). Answered at once, not retryable.
- **under way**: the engine is paused, asleep or taking a weight-transfer update
  (a refit is under way on it), which may bring the version, and the rollout
  requires another than the committed one. Answered, retryable: the driver
  retries it as before (the frontend does not migrate an answer), and its last
  refusal names the versions.
- anything else (no record, the engine already on the version required, a worker
  that lags the record or is paused off the committed version the rollout
  requires, the state or the record unreadable): passed on migratable, as
  before, so that the frontend hands it to a worker that may serve it.

An answered refusal travels as the rollout's one chunk, its ``engine_data``
holding ``rl_client.wire.REFUSAL_KEY`` instead of the result: the only answer
both frontends pass through with its words. The driver raises it as
``WeightVersionRefusedError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from engine_contract.v1 import engine_pb2 as pb
from rl_client.committed import CommittedRecord, CommittedStore
from rl_client.wire import WeightVersionRefusal

log = logging.getLogger(__name__)

# How the engine server's guard refusal begins (engine_server.errors.WeightVersionMismatch:
# the field's name, as every request refusal of the core).
GUARD_REFUSAL_PREFIX = "required_weight_version:"


def is_guard_refusal(err: BaseException) -> bool:
    """Whether ``err`` is an engine server's refusal of a version-guarded request."""
    return (
        isinstance(err, grpc.aio.AioRpcError)
        and err.code() == grpc.StatusCode.ABORTED
        and (err.details() or "").startswith(GUARD_REFUSAL_PREFIX)
    )


def judge(
    required: str,
    state: pb.RefitState,
    record: CommittedRecord | None,
    *,
    instance_id: str = "",
    request_id: str = "",
) -> WeightVersionRefusal | None:
    """The refusal to answer for a rollout requiring ``required`` that an engine in
    ``state`` refused, given the fleet's ``record``; None: pass the engine's
    refusal on, migratable (see the module docs)."""
    if record is None or state.weight_version == required:
        return None
    committed = record.weights.version
    serving = state.weight_version
    worker = f"worker {instance_id}" if instance_id else "the worker"
    versions = f"required {required!r}, serving {serving!r}, committed {committed!r}"
    why = (
        "paused"
        if state.paused
        else "asleep"
        if state.sleeping
        else "taking a weight-transfer update"
        if state.weight_update_open
        else None
    )
    if why is not None and required != committed:
        return WeightVersionRefusal(
            required=required,
            serving=serving,
            committed=committed,
            retryable=True,
            message=(
                f"weight version {required!r} refused for now ({versions}): {worker} is "
                f"{why} for a refit, which may bring it; worth sending again"
            ),
            request_id=request_id,
            instance_id=instance_id,
        )
    if state.weight_version_declared and serving == committed:
        return WeightVersionRefusal(
            required=required,
            serving=serving,
            committed=committed,
            retryable=False,
            message=(
                f"weight version {required!r} refused for good ({versions}): the fleet "
                f"committed {committed!r} and {worker} serves it with no refit under way, "
                f"so no worker will serve {required!r} again; not retried: send the rollout "
                f"for {committed!r}"
            ),
            request_id=request_id,
            instance_id=instance_id,
        )
    return None


async def refusal_for(
    required: str,
    read_state: Callable[[], Awaitable[pb.GetLoadResponse]],
    store: CommittedStore,
    timeout_s: float,
    *,
    instance_id: str = "",
    request_id: str = "",
) -> WeightVersionRefusal | None:
    """``judge`` on fresh reads: the engine's state (``read_state()``), then
    the record (so that an unpaused engine on version V means the record was
    published at least as late as V's). None, logged, when either cannot be read
    within ``timeout_s``: the refusal is passed on as before. One GetLoad and one
    record read per refusal (a file, or one etcd key), only ever on this path."""
    try:
        async with asyncio.timeout(timeout_s):
            load = await read_state()
            if load.refit_state.weight_version == required:
                return None  # labelled since (or part way through an update): migratable
            record = await asyncio.to_thread(store.read)
    except Exception as e:  # an engine or a store that does not answer; a bad record
        log.debug("weight-version refusal of %s: passed on (%r)", request_id, e)
        return None
    return judge(required, load.refit_state, record, instance_id=instance_id, request_id=request_id)
