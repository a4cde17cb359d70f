"""The engine-server contract: generated stubs (``engine_contract.v1``) and its revision.

Both processes import this one package, so the .proto is registered once in
protobuf's descriptor pool. Only ``v1/*_pb2*.py`` are generated (``make proto``);
this file and ``v1/__init__.py`` are written by hand.
"""

# Bump on every behavioural change to the contract. Servers accept clients from
# MINIMUM_CLIENT_REVISION on; clients accept servers from MINIMUM_SERVER_REVISION on.
CONTRACT_REVISION = 1
MINIMUM_CLIENT_REVISION = 1
MINIMUM_SERVER_REVISION = 1

SERVICE_NAME = "engine_contract.v1.EngineService"

__all__ = [
    "CONTRACT_REVISION",
    "MINIMUM_CLIENT_REVISION",
    "MINIMUM_SERVER_REVISION",
    "SERVICE_NAME",
]
