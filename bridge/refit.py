"""Moved to ``rl_client.refit``: this path keeps the public names importable
(``from bridge.refit import RefitClient``). New code imports ``rl_client.refit``."""

from rl_client.refit import (
    ContractWeightSyncClient,
    DynamoWeightSyncClient,
    EngineRefitClient,
    RefitClient,
    RefitError,
    RefitReport,
    RouteError,
    WorkerRefit,
)

__all__ = [
    "ContractWeightSyncClient",
    "DynamoWeightSyncClient",
    "EngineRefitClient",
    "RefitClient",
    "RefitError",
    "RefitReport",
    "RouteError",
    "WorkerRefit",
]
