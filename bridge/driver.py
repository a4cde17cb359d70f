"""Moved to ``rl_client.driver``: this path keeps the public names importable
(``from bridge.driver import RolloutClient``). New code imports ``rl_client.driver``."""

from rl_client.driver import (
    RETRYABLE_STATUSES,
    RetryPolicy,
    RolloutCancelledError,
    RolloutClient,
    RolloutHTTPError,
    RolloutResult,
    RoutedExperts,
    WireError,
    build_rollout_body,
    parse_rollout_response,
    rollout_annotation,
)

__all__ = [
    "RETRYABLE_STATUSES",
    "RetryPolicy",
    "RolloutCancelledError",
    "RolloutClient",
    "RolloutHTTPError",
    "RolloutResult",
    "RoutedExperts",
    "WireError",
    "build_rollout_body",
    "parse_rollout_response",
    "rollout_annotation",
]
