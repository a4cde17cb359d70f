"""Issue 12, item 7: every string a request carries is bounded at admission and never
echoed whole into a status message.

A status message travels in a trailer, and gRPC refuses trailers over its
metadata limit: a 100,000-character id echoed whole turned OUT_OF_RANGE into
RESOURCE_EXHAUSTED on the client, losing "resubscribe with a snapshot". Here
every string (and bytes) field of every EngineService request gets 100,000
characters: the answer is a refusal with a short message (or a short answer),
never RESOURCE_EXHAUSTED, UNKNOWN or INTERNAL, and never the long value echoed
back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, idle, sim_cli_args, wait_load

SERVICE = pb.DESCRIPTOR.services_by_name["EngineService"]
LONG = 100_000
# A status message, or an answer, that echoes nothing long stays far below this.
SHORT = 1024
BAD_CODES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# Refit steps run only while generation is paused: pause first, so that the long
# field is what the server judges.
NEEDS_PAUSE = {"UpdateWeightsFromPath", "UpdateWeightsFromTensors", "StartWeightUpdate"}


def string_fields(
    descriptor: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()
) -> Iterator[tuple[FieldDescriptor, ...]]:
    """Paths to every string and bytes field, at most three messages deep."""
    for field in descriptor.fields:
        path = (*prefix, field)
        if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            yield path
        elif field.type == FieldDescriptor.TYPE_MESSAGE and len(prefix) < 2:
            yield from string_fields(field.message_type, path)


CASES = [
    pytest.param(method, path, id=f"{method.name}.{'.'.join(f.name for f in path)}")
    for method in SERVICE.methods
    for path in string_fields(method.input_type)
]


def base_request(method: MethodDescriptor) -> Message:
    """A request that is valid but for the field under test."""
    request: Any = message_factory.GetMessageClass(method.input_type)()
    if method.name in ("Rollout", "Generate"):
        request.request_id = "long-strings"
        request.prompt_token_ids.append(5)
    if method.name == "Generate":
        request.stop.max_tokens = 1
    if method.name == "Rollout":
        request.max_new_tokens = 1
    if method.name == "Rollouts":
        start = request.start.add(tag=1)
        start.rollout.request_id = "long-strings"
        start.rollout.prompt_token_ids.append(5)
        start.rollout.max_new_tokens = 1
    if method.name == "Generates":
        start = request.start.add(tag=1)
        start.generate.request_id = "long-strings"
        start.generate.prompt_token_ids.append(5)
        start.generate.stop.max_tokens = 1
    if method.name == "Abort":
        request.request_id = "long-strings"
    if method.name == "SubscribeKvEvents":
        request.start_sequence_number = 5
    if method.name == "UpdateWeightsFromPath":
        request.path = "/nonexistent-checkpoint"
    if method.name == "UpdateWeightsFromTensors":
        request.manifest.tensors.add(name="w", dtype=pb.TENSOR_DTYPE_FLOAT32, shape=[1])
    return request


def is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def with_long(request: Message, path: tuple[FieldDescriptor, ...]) -> Message:
    target = request
    for field in path[:-1]:
        if is_map(field):  # a long key, or a known key's long value
            entries = getattr(target, field.name)
            if path[-1].name == "key":
                entries["i" * LONG] = "v"
            else:
                entries["traceparent"] = "i" * LONG
            return request
        if field.is_repeated:
            items = getattr(target, field.name)
            target = items[0] if len(items) else items.add()
        else:
            target = getattr(target, field.name)
    field = path[-1]
    value: str | bytes = "i" * LONG
    if field.type == FieldDescriptor.TYPE_BYTES:
        value = b'{"' + b"i" * LONG + b'": 1}'  # JSON fields: valid JSON, one long key
    if field.is_repeated:
        items = getattr(target, field.name)
        if len(items):
            items[0] = value
        else:
            items.append(value)
    else:
        setattr(target, field.name, value)
    return request


def answer(
    channel: grpc.Channel, method: MethodDescriptor, request: Message
) -> tuple[grpc.StatusCode, str, int]:
    """(status, details, bytes of the longest answer message); a Rollouts result's
    or a Generates delta's error counts as the status."""
    path = f"/{SERVICE.full_name}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    kw = {
        "request_serializer": lambda m: m.SerializeToString(),
        "response_deserializer": out_cls.FromString,
    }
    biggest = 0
    try:
        if method.client_streaming and method.server_streaming:
            for message in channel.stream_stream(path, **kw)(iter([request]), timeout=10):
                biggest = max(biggest, message.ByteSize())
                items = message.results if method.name == "Rollouts" else message.deltas
                for result in items:
                    if result.HasField("error"):
                        code = next(c for c in grpc.StatusCode if c.value[0] == result.error.code)
                        return code, result.error.message, biggest
        elif method.client_streaming:
            biggest = channel.stream_unary(path, **kw)(iter([request]), timeout=10).ByteSize()
        elif method.server_streaming:
            call = channel.unary_stream(path, **kw)(request, timeout=10)
            for message in call:
                biggest = max(biggest, message.ByteSize())
                call.cancel()  # a subscription that was accepted: its first message will do
                break
        else:
            biggest = channel.unary_unary(path, **kw)(request, timeout=10).ByteSize()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and biggest:
            return grpc.StatusCode.OK, "", biggest
        return e.code(), e.details() or "", biggest
    return grpc.StatusCode.OK, "", biggest


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    server = InProcessServer.from_cli(*sim_cli_args("--zero-delay")).start()
    yield server
    server.stop()


def test_kv_subscription_with_a_huge_expected_instance_id(server: InProcessServer) -> None:
    """The issue's repro: OUT_OF_RANGE or INVALID_ARGUMENT, with a short message."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        call = stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(start_sequence_number=5, expected_instance_id="i" * LONG),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(call))
        err = refused.value
        assert err.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT), err
        assert len((err.details() or "").encode()) < SHORT, err.details()
        assert "expected_instance_id" in (err.details() or "")


def test_rollout_with_a_huge_request_id(server: InProcessServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Rollout(
                pb.RolloutRequest(request_id="x" * LONG, prompt_token_ids=[5], max_new_tokens=1),
                timeout=10,
            )
        err = refused.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert len((err.details() or "").encode()) < SHORT and "request_id" in (err.details() or "")


@pytest.mark.parametrize(("method", "path"), CASES)
def test_every_string_field_is_bounded(
    server: InProcessServer, method: MethodDescriptor, path: tuple[FieldDescriptor, ...]
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        version = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version
        paused = method.name in NEEDS_PAUSE
        if paused:
            stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT), timeout=10)
        try:
            request = with_long(base_request(method), path)
            code, details, biggest = answer(channel, method, request)
        finally:
            if paused:
                stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
            now = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version
            if now != version:  # accepted: put the old label back for the next cases
                stub.UpdateWeightVersion(
                    pb.UpdateWeightVersionRequest(weight_version=version), timeout=10
                )
    field = ".".join(f.name for f in path)
    assert code not in BAD_CODES, f"{method.name} {field}: {code.name}: {details[:300]}"
    assert len(details.encode()) < SHORT, f"{method.name} {field}: echoed {details[:300]}..."
    assert biggest < SHORT, (
        f"{method.name} {field}: a {LONG}-character value was accepted and came back in "
        f"a {biggest}-byte answer"
    )
    wait_load(server.address, idle, 10)


def test_a_huge_weight_version_is_not_carried_by_every_rollout(server: InProcessServer) -> None:
    """The weight version labels every RolloutResponse (weight_versions): accepted
    unbounded, it would make every answer as long as itself."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        before = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version
        try:
            stub.UpdateWeightVersion(
                pb.UpdateWeightVersionRequest(weight_version="v" * LONG), timeout=10
            )
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert len((e.details() or "").encode()) < SHORT
        rollout = stub.Rollout(
            pb.RolloutRequest(request_id="after-version", prompt_token_ids=[5], max_new_tokens=2),
            timeout=10,
        )
        try:
            assert rollout.ByteSize() < SHORT, (
                f"a 2-token rollout's answer is {rollout.ByteSize()} bytes: it carries the "
                f"{LONG}-character weight version"
            )
        finally:
            stub.UpdateWeightVersion(
                pb.UpdateWeightVersionRequest(weight_version=before or "v0"), timeout=10
            )
