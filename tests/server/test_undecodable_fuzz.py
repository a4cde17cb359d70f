"""Issue 12, item 6: request bytes that are not a valid message are answered
INVALID_ARGUMENT (or RESOURCE_EXHAUSTED), never UNKNOWN or INTERNAL, by every
EngineService method; the server stays healthy and idle.

A fixed-seed corpus per method: crafted cases (field number 0, overlong and
truncated varints, a truncated length, invalid UTF-8 in a string field, wire
types 6 and 7, groups nested past the parser's depth limit, a stray end-group)
and random bytes. Random bytes sometimes decode validly; then any answer but
UNKNOWN and INTERNAL will do. Whether bytes decode is decided here with the same
generated message class the server parses with.

``FUZZ_CASES=2000`` (random cases per method, default 20) and ``FUZZ_SEED`` make
a longer or another run.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message as protobuf_message
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, health_status, idle, sim_cli_args, wait_load

SERVICE = pb.DESCRIPTOR.services_by_name["EngineService"]
RANDOM_CASES = int(os.environ.get("FUZZ_CASES", "20"))
SEED = int(os.environ.get("FUZZ_SEED", "12"))
# Refusals of bytes that do not decode.
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Never an answer, whatever the bytes.
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def delimited(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


def string_path(descriptor: Descriptor, depth: int = 0) -> list[FieldDescriptor] | None:
    """The fields down to the first string field (at most three messages deep)."""
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            return [field]
    if depth < 3:
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                below = string_path(field.message_type, depth + 1)
                if below is not None:
                    return [field, *below]
    return None


def crafted(method: MethodDescriptor) -> dict[str, bytes]:
    cases = {
        "field number 0": b"\x00\x01",
        "overlong varint": b"\x08" + b"\xff" * 10 + b"\x01",
        "truncated varint": b"\x08\xff",
        "truncated length": b"\x0a\x05ab",
        "length past 2 GiB": b"\x0a" + varint(1 << 31) + b"x",
        "wire type 6": b"\x0e\x01",
        "wire type 7": b"\x0f\x01",
        "groups nested 1000 deep": b"\x0b" * 1000 + b"\x0c" * 1000,
        "unknown field's groups nested 1000 deep": tag(1000, 3) * 1000 + tag(1000, 4) * 1000,
        "end-group without a start": b"\x0c",
        "mismatched end-group": b"\x0b\x14",
    }
    path = string_path(method.input_type)
    if path is not None:
        payload = b"\xc3\x28\xff"
        for field in reversed(path):
            payload = delimited(field.number, payload)
        cases["invalid UTF-8 in " + ".".join(f.name for f in path)] = payload
    return cases


def corpus(method: MethodDescriptor) -> Iterator[tuple[str, bytes]]:
    yield from crafted(method).items()
    rng = random.Random(f"{SEED}/{method.name}")
    for i in range(RANDOM_CASES):
        yield f"random {i}", rng.randbytes(rng.randint(1, 64))


def decodes(method: MethodDescriptor, data: bytes) -> bool:
    cls = message_factory.GetMessageClass(method.input_type)
    try:
        cls.FromString(data)
    except (protobuf_message.DecodeError, RecursionError):
        return False
    return True


def call(channel: grpc.Channel, method: MethodDescriptor, data: bytes) -> grpc.StatusCode:
    """Send ``data`` as the request (as the stream's one message, for a client
    stream); read a server stream to its end (a valid subscription for a second)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    raw = {"request_serializer": lambda x: x, "response_deserializer": lambda x: x}
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path, **raw)(iter([data]), timeout=10):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, **raw)(iter([data]), timeout=10)
        elif method.server_streaming:
            responses = channel.unary_stream(path, **raw)(data, timeout=1)
            for _ in responses:
                pass
        else:
            channel.unary_unary(path, **raw)(data, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    server = InProcessServer.from_cli(*sim_cli_args("--zero-delay")).start()
    yield server
    server.stop()


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_undecodable_requests_are_invalid_argument(
    server: InProcessServer, method: MethodDescriptor
) -> None:
    wrong: list[str] = []
    answers: Counter[str] = Counter()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for name, data in corpus(method):
            valid = decodes(method, data)
            code = call(channel, method, data)
            answers[f"{code.name}{'' if not valid else ' (decodes)'}"] += 1
            if code in NEVER or (not valid and code not in REFUSED):
                wrong.append(f"{name} {data[:24]!r}: {code.name}")
            # Random bytes that happen to be a valid pause or sleep: undo it.
            if valid and method.name in ("PauseGeneration", "Sleep"):
                if stub.IsSleeping(pb.IsSleepingRequest(), timeout=10).sleeping:
                    stub.WakeUp(pb.WakeUpRequest(), timeout=10)
                if stub.IsPaused(pb.IsPausedRequest(), timeout=10).paused:
                    stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
    assert not wrong, (
        f"{method.name}: {len(wrong)} wrong answers, e.g. {wrong[:6]} (all: {dict(answers)})"
    )
    # The crafted cases are undecodable (b"\x00\x01" decodes as an empty message).
    assert sum(not decodes(method, data) for data in crafted(method).values()) >= 10
    assert health_status(server.address) == health_pb2.HealthCheckResponse.SERVING
    wait_load(server.address, idle, 10, f"idle after fuzzing {method.name}")


def test_undecodable_message_mid_stream_ends_the_rollouts_call(server: InProcessServer) -> None:
    """Bad bytes after a valid message on a Rollouts stream: the call ends
    INVALID_ARGUMENT (which rollouts they meant is unknowable), nothing leaks."""
    method = SERVICE.methods_by_name["Rollouts"]
    first = pb.RolloutsRequest(
        start=[
            pb.RolloutStart(
                tag=1,
                rollout=pb.RolloutRequest(
                    request_id="mid-stream", prompt_token_ids=[5, 6], max_new_tokens=2
                ),
            )
        ]
    ).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        for name, data in crafted(method).items():
            if decodes(method, data):
                continue
            call = channel.stream_stream(
                f"/{SERVICE.full_name}/Rollouts",
                request_serializer=lambda x: x,
                response_deserializer=pb.RolloutsResponse.FromString,
            )(iter([first, data]), timeout=10)
            with pytest.raises(grpc.RpcError) as ended:
                for _ in call:
                    pass
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, ended.value)
    wait_load(server.address, idle, 10, "idle after the broken streams")
