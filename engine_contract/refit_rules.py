"""The refit cycle's vocabulary and rules, one copy for both sides of the contract.

- **Pause modes** by name, as trainers and dynamo.vllm's RL routes spell them
  (``keep|wait|abort``), and as the contract's ``PauseMode`` values. The engine
  server's own ``PauseMode`` enum carries the same names; an unset mode is
  ABORT, as in vLLM.
- **The weight-update rules**: an update needs generation paused unless it sets
  ``allow_unpaused``, and an unpaused update cannot reset the prefix cache
  (running requests hold it). The engine server enforces them on every update
  RPC (``update_refusal``) and answers in dynamo.vllm's words: its status
  message *is* the RL route's answer, which the bridge passes on as it comes.
  A route that answers before any RPC (dynamo.vllm's order of checks) asks the
  same function.
"""

from __future__ import annotations

import enum

from engine_contract.v1 import engine_pb2 as pb

# The one map: a mode's name <-> the contract's value (UNSPECIFIED is ABORT, as in vLLM).
PAUSE_MODES: dict[str, pb.PauseMode] = {
    "keep": pb.PAUSE_MODE_KEEP,
    "wait": pb.PAUSE_MODE_WAIT,
    "abort": pb.PAUSE_MODE_ABORT,
}
PAUSE_MODE_NAMES: dict[pb.PauseMode, str] = {
    pb.PAUSE_MODE_UNSPECIFIED: "abort",
    **{value: name for name, value in PAUSE_MODES.items()},
}
# As an answer spells the choice ("expected keep|wait|abort").
PAUSE_MODE_CHOICES = "|".join(PAUSE_MODES)


def pause_mode(name: str) -> pb.PauseMode:
    """The contract's value of a mode's name; ValueError naming the choices."""
    try:
        return PAUSE_MODES[name]
    except KeyError:
        raise ValueError(f"unknown pause mode {name!r}; expected {PAUSE_MODE_CHOICES}") from None


class UpdateRefusal(enum.Enum):
    """Why a weight update is refused; the value is the answer, dynamo.vllm's words."""

    # FAILED_PRECONDITION: not now (pause first).
    NOT_PAUSED = (
        "Worker must be paused via pause_generation() before updating weights. Call "
        "pause_generation() first, then update, then resume_generation()."
    )
    # INVALID_ARGUMENT: never, whatever the state.
    UNPAUSED_CACHE_RESET = (
        "Unpaused weight updates cannot reset the prefix cache. Set "
        "'reset_prefix_cache' to false or pause generation first."
    )


# How a fenced weight or label change another writer overtook is refused
# (contract revision 10): the words a client recognises it by, over gRPC
# (FAILED_PRECONDITION) and the RL routes alike.
STALE_WRITER = "a stale writer"

# How a path or tensor update is refused while a weight-transfer update is open on
# the engine (contract revision 12): as STALE_WRITER's, the words a client
# recognises it by, for another writer holds the engine.
UPDATE_OPEN = "a weight-transfer update is open"
# How an open update ends, as every refusal and wait on one names it.
UPDATE_WAYS_OUT = (
    "its writer ends it (FinishWeightUpdate; a writer that is gone: "
    "ShutdownWeightTransferEngine ends it, or FinishWeightUpdate where the engine "
    "refuses that)"
)


class PhaseRefusal(enum.Enum):
    """A weight-transfer phase out of order (FAILED_PRECONDITION); the value is the
    engine server's answer, which the RL routes recognise to name the order."""

    NOT_STARTED = "no weight update in progress: call StartWeightUpdate first"
    ALREADY_STARTED = "a weight update is already in progress: finish it first"


# The weight-transfer phases in order, as dynamo.vllm's engine_rpc names them.
PHASE_ORDER = (
    "the phases run in order: start_weight_update, then update_weights (once or more), "
    "then finish_weight_update, one update at a time"
)


def needs_pause(options: pb.WeightUpdateOptions) -> bool:
    """Whether an update with these options needs generation paused."""
    return not options.allow_unpaused


def update_refusal(
    options: pb.WeightUpdateOptions, paused: bool | None = None
) -> UpdateRefusal | None:
    """The rules for one update, in dynamo.vllm's order: the options' own rule
    first, then "paused". ``paused``: whether generation is paused now; None when
    not known yet (only the options are checked). An unpaused update resets no
    cache unless ``reset_prefix_cache`` asks it to, which is refused."""
    if options.allow_unpaused:
        if options.HasField("reset_prefix_cache") and options.reset_prefix_cache:
            return UpdateRefusal.UNPAUSED_CACHE_RESET
        return None
    if paused is False:
        return UpdateRefusal.NOT_PAUSED
    return None
