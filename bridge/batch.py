"""Moved to ``rl_client.batch``: this path keeps the public names importable
(``from bridge.batch import generate_batch``). New code imports ``rl_client.batch``."""

from rl_client.batch import (
    FALLBACK_ROUTED_EXPERTS_DTYPE,
    MISSING_ROUTE,
    GenerationOutput,
    assemble,
    generate_batch,
    prompts_from_padded,
    routed_experts_dtype,
)

__all__ = [
    "FALLBACK_ROUTED_EXPERTS_DTYPE",
    "MISSING_ROUTE",
    "GenerationOutput",
    "assemble",
    "generate_batch",
    "prompts_from_padded",
    "routed_experts_dtype",
]
