"""What Prime-RL's Dynamo client asks of a worker, for the tests that check a
bridge offers it: stated once, as Prime-RL's source has it, so that the unit
test of the listed routes and the end-to-end test of discovery cannot drift
apart when Prime-RL's client changes."""

from __future__ import annotations

# The routes Prime-RL's Dynamo client requires of a worker, in the sidecar's
# spelling, as the ``rl`` endpoint lists them (src/prime_rl/utils/dynamo.py).
PRIME_RL_ROUTES = frozenset(
    {
        "control/pause_generation",
        "control/resume_generation",
        "control/is_paused",
        "control/get_weight_version",
        "update/update_weight_version",
        "update/init_weight_transfer_engine",
        "update/start_weight_update",
        "update/update_weights",
        "update/finish_weight_update",
    }
)
