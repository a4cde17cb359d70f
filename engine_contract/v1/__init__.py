"""Generated messages and stubs of ``engine_contract.v1`` (see proto/)."""

from engine_contract.v1 import engine_pb2, engine_pb2_grpc

__all__ = ["engine_pb2", "engine_pb2_grpc"]
