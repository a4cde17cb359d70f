"""What a replaced engine server may change, and what Dynamo's registration cannot follow.

The bridge registers its engine server's model and shape with Dynamo once, at
start (the model card, context length, KV block size, data-parallel ranks).
When a new engine-server instance appears at the same address (restarted,
upgraded, another backend), the bridge re-reads its info: a different
contract revision (within the supported window), limits or backend it adapts
to; a different model or shape it cannot, because the frontend and the KV
router keep what was registered. Those are listed here, so that the bridge can
say so and leave the router's pool rather than serve answers that do not fit.
"""

from __future__ import annotations

from engine_contract.v1 import engine_pb2 as pb


def unfollowable_changes(
    old: pb.GetServerInfoResponse,
    new: pb.GetServerInfoResponse,
    *,
    name_pinned: bool,
    kv_routing: bool,
) -> list[str]:
    """Differences the registration cannot follow, in words (empty: adapt)."""
    changes = []
    if not name_pinned and new.model_name != old.model_name:
        changes.append(f"model name {old.model_name!r} -> {new.model_name!r}")
    a, b = old.engine_config, new.engine_config
    if b.context_length != a.context_length:
        changes.append(f"context length {a.context_length} -> {b.context_length}")
    if kv_routing and b.kv_block_size != a.kv_block_size:
        changes.append(f"KV block size {a.kv_block_size} -> {b.kv_block_size}")
    if (b.data_parallel_size, b.data_parallel_start_rank) != (
        a.data_parallel_size,
        a.data_parallel_start_rank,
    ):
        changes.append(
            f"data-parallel ranks {a.data_parallel_size}@{a.data_parallel_start_rank} -> "
            f"{b.data_parallel_size}@{b.data_parallel_start_rank}"
        )
    if new.vocab_size != old.vocab_size:
        changes.append(f"vocabulary size {old.vocab_size} -> {new.vocab_size}")
    return changes
