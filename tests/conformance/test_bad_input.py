"""Bad input: a clear status naming the field, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from tests.conformance.common import collect, make_prompt, new_id

Info = pb.GetServerInfoResponse


def rollout(info: Info, **kw: object) -> pb.RolloutRequest:
    kw.setdefault("request_id", new_id("bad"))
    kw.setdefault("prompt_token_ids", make_prompt(info, 4, 1))
    return pb.RolloutRequest(**kw)  # type: ignore[arg-type]


def generate(info: Info, mutate: Callable[[pb.GenerateRequest], object]) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=new_id("bad"), prompt_token_ids=make_prompt(info, 4, 1))
    mutate(request)
    return request


ROLLOUT_CASES: dict[str, tuple[Callable[[Info], pb.RolloutRequest], str]] = {
    "empty prompt": (lambda i: rollout(i, prompt_token_ids=[]), "prompt_token_ids"),
    "negative token id": (lambda i: rollout(i, prompt_token_ids=[5, -1]), "prompt_token_ids[1]"),
    "token id = vocab size": (
        lambda i: rollout(i, prompt_token_ids=[5, i.vocab_size]),
        "prompt_token_ids[1]",
    ),
    "negative max_new_tokens": (lambda i: rollout(i, max_new_tokens=-1), "max_new_tokens"),
    "max_new_tokens past the context": (
        lambda i: rollout(i, max_new_tokens=i.engine_config.context_length + 1),
        "max_new_tokens",
    ),
    "empty stop string": (lambda i: rollout(i, stop_strings=["ok", ""]), "stop_strings[1]"),
    "too many stop strings": (
        lambda i: rollout(i, stop_strings=[f"s{n}" for n in range(i.limits.max_stop_strings + 1)]),
        "stop_strings",
    ),
    "empty request id": (lambda i: rollout(i, request_id=""), "request_id"),
    "request id too long": (
        lambda i: rollout(i, request_id="x" * (i.limits.max_request_id_length + 1)),
        "request_id",
    ),
    "unknown enum value": (lambda i: rollout(i, routed_experts=99), "routed_experts"),
    "empty cache salt": (lambda i: rollout(i, cache_salt=""), "cache_salt"),
}

GENERATE_CASES: dict[str, tuple[Callable[[pb.GenerateRequest], object], str]] = {
    "negative max_tokens": (lambda r: setattr(r.stop, "max_tokens", -5), "stop.max_tokens"),
    "max_tokens past the context": (
        lambda r: setattr(r.stop, "max_tokens", 10**9),
        "stop.max_tokens",
    ),
    "negative temperature": (
        lambda r: setattr(r.sampling, "temperature", -1.0),
        "sampling.temperature",
    ),
    "top_p zero": (lambda r: setattr(r.sampling, "top_p", 0.0), "sampling.top_p"),
    "stop token out of vocabulary": (
        lambda r: r.stop.stop_token_ids.append(-3),
        "stop.stop_token_ids[0]",
    ),
    "empty stop string": (lambda r: r.stop.stop_strings.append(""), "stop.stop_strings[0]"),
    "too many top logprobs": (lambda r: setattr(r.output, "logprobs", 10**6), "output.logprobs"),
    "unknown enum value": (
        lambda r: setattr(r.output, "routed_experts", 42),
        "output.routed_experts",
    ),
    "cache salt with a newline": (lambda r: setattr(r, "cache_salt", "a\nb"), "cache_salt"),
    "cache salt too long": (lambda r: setattr(r, "cache_salt", "s" * 257), "cache_salt"),
}


async def assert_still_serving(stub) -> None:  # type: ignore[no-untyped-def]
    info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    answer = await stub.Rollout(rollout(info, max_new_tokens=1))
    assert len(answer.token_ids) <= 1


async def assert_invalid_argument(stub, call: Awaitable[object], start: str) -> None:  # type: ignore[no-untyped-def]
    """``call`` fails INVALID_ARGUMENT, its message starting with ``start`` (the
    field it names), and the server still serves."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(start), err.value.details()
    await assert_still_serving(stub)


@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
async def test_a_malformed_rollout_is_invalid_argument_naming_its_field(
    stub, server_info, case: str
) -> None:  # type: ignore[no-untyped-def]
    build, field = ROLLOUT_CASES[case]
    await assert_invalid_argument(stub, stub.Rollout(build(server_info)), field + ":")


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
async def test_a_malformed_generate_is_invalid_argument_naming_its_field(
    stub, server_info, case: str
) -> None:  # type: ignore[no-untyped-def]
    mutate, field = GENERATE_CASES[case]
    await assert_invalid_argument(stub, collect(stub, generate(server_info, mutate)), field + ":")


async def test_a_message_over_the_size_limit_is_resource_exhausted(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    limit = server_info.limits.max_message_bytes
    if limit > 16 * 1024 * 1024:
        pytest.skip(f"the server's limit ({limit} bytes) is too large to test cheaply")
    request = rollout(server_info, stop_strings=["x" * (limit + 1)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rollout(request)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await assert_still_serving(stub)


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [({}, "target"), ({"request_id": ""}, "request_id"), ({"all": False}, "all")],
)
async def test_a_malformed_abort_is_invalid_argument_naming_its_field(
    stub, request_kw: dict[str, object], field: str
) -> None:  # type: ignore[no-untyped-def]
    request = pb.AbortRequest(**request_kw)  # type: ignore[arg-type]
    if "request_id" in request_kw:
        request.request_id = ""  # set the oneof to an empty id explicitly
    await assert_invalid_argument(stub, stub.Abort(request), field)
