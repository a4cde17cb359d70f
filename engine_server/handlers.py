"""EngineService's method handlers, with request parsing that never answers UNKNOWN.

The generated ``add_EngineServiceServicer_to_server`` parses requests with
``Message.FromString``: bytes that are not a valid message (a field number 0,
an overlong varint, a truncated length, bad UTF-8 in a string, a group nested
too deep) raise ``DecodeError`` inside gRPC, which answers UNKNOWN, and the
bridge turns UNKNOWN into HTTP 500. Here the same handlers are built from the
service descriptor with a parser that hands such bytes to the method as an
``Undecodable``; the status boundary (``status.rpc``) and the Rollouts stream
answer it INVALID_ARGUMENT, as the contract promises for a bad request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message as protobuf_message
from google.protobuf import message_factory

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["EngineService"]


class Undecodable:
    """Request bytes that are not a valid message of the method's request type."""

    __slots__ = ("reason", "type_name")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    def __str__(self) -> str:
        return f"request is not a valid {self.type_name} message: {self.reason}"


def _tolerant_parser(cls: type[protobuf_message.Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> protobuf_message.Message | Undecodable:
        try:
            return cls.FromString(data)
        except (protobuf_message.DecodeError, RecursionError) as e:
            return Undecodable(cls.DESCRIPTOR.name, str(e) or type(e).__name__)

    return parse


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _servicer_methods(servicer: pb_grpc.EngineServiceServicer) -> dict[str, Callable[..., Any]]:
    """The servicer's method for each RPC, named as the attributes they are (no
    lookup by name: the type checker sees each one)."""
    s = servicer
    return {
        "GetServerInfo": s.GetServerInfo,
        "Rollout": s.Rollout,
        "Rollouts": s.Rollouts,
        "Generate": s.Generate,
        "Generates": s.Generates,
        "Abort": s.Abort,
        "SubscribeKvEvents": s.SubscribeKvEvents,
        "ResetPrefixCache": s.ResetPrefixCache,
        "GetLoad": s.GetLoad,
        "GetEngineMetrics": s.GetEngineMetrics,
        "PauseGeneration": s.PauseGeneration,
        "ResumeGeneration": s.ResumeGeneration,
        "IsPaused": s.IsPaused,
        "UpdateWeightsFromPath": s.UpdateWeightsFromPath,
        "UpdateWeightsFromTensors": s.UpdateWeightsFromTensors,
        "InitWeightTransferEngine": s.InitWeightTransferEngine,
        "StartWeightUpdate": s.StartWeightUpdate,
        "UpdateWeights": s.UpdateWeights,
        "FinishWeightUpdate": s.FinishWeightUpdate,
        "ShutdownWeightTransferEngine": s.ShutdownWeightTransferEngine,
        "GetWeightVersion": s.GetWeightVersion,
        "UpdateWeightVersion": s.UpdateWeightVersion,
        "Sleep": s.Sleep,
        "WakeUp": s.WakeUp,
        "IsSleeping": s.IsSleeping,
    }


def add_engine_servicer(servicer: pb_grpc.EngineServiceServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer``'s methods (one per EngineService RPC) on ``server``."""
    methods = _servicer_methods(servicer)
    served = {method.name for method in SERVICE.methods}
    if served != methods.keys():
        raise RuntimeError(
            f"EngineService's RPCs and the servicer's methods differ: "
            f"{sorted(served.symmetric_difference(methods))}"
        )
    handlers = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            methods[method.name],
            request_deserializer=_tolerant_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
