"""The driver retries what may succeed again (408, 429, 5xx, lost connections), never a 4xx,
and says clearly when the frontend cancelled a rollout."""

from __future__ import annotations

import json
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine_contract.v1 import engine_pb2 as pb
from rl_client import driver
from tests.bridge.bridge_fakes import fake_frontend, frontend_body

FAST = driver.RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02)


def answer() -> dict[str, Any]:
    return frontend_body(
        pb.RolloutResponse(
            request_id="x", token_ids=[4], logprobs=[-0.25], finish_reason=pb.FINISH_REASON_STOP
        )
    )


async def serve(statuses: list[int]) -> tuple[Any, str, list[dict[str, Any]]]:
    """A frontend answering each request with the next status (200: a rollout)."""
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        status = statuses[len(seen) - 1]
        if status == 200:
            return web.json_response(answer())
        return web.json_response({"error": {"message": f"status {status}"}}, status=status)

    runner, url = await fake_frontend(handler)
    return runner, url, seen


@pytest.mark.parametrize("status", [408, 429, 500, 503])
async def test_retryable_statuses_are_sent_again(status: int) -> None:
    runner, url, seen = await serve([status, status, 200])
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            result = await client.rollout([1, 2], request_id="rid")
        assert result.token_ids == [4] and len(seen) == 3
        # Each retry runs under an id of its own (the first try may still be aborting).
        ids = [driver_spec(body)["request_id"] for body in seen]
        assert ids == ["rid", "rid.2", "rid.3"]
    finally:
        await runner.cleanup()


def driver_spec(body: dict[str, Any]) -> dict[str, Any]:
    (annotation,) = body["nvext"]["annotations"]
    return dict(json.loads(annotation.removeprefix("rollout:")))


async def test_retries_give_up_with_the_last_error() -> None:
    runner, url, seen = await serve([503, 502, 500])
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            with pytest.raises(driver.RolloutHTTPError) as err:
                await client.rollout([1])
        assert err.value.status == 500 and err.value.retryable and len(seen) == 3
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [400, 404, 413, 422])
async def test_client_errors_are_never_retried(status: int) -> None:
    runner, url, seen = await serve([status, 200])
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            with pytest.raises(driver.RolloutHTTPError) as err:
                await client.rollout([1])
        assert err.value.status == status and not err.value.retryable and len(seen) == 1
    finally:
        await runner.cleanup()


async def test_a_refused_connection_is_retried_then_raised() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with driver.RolloutClient(f"http://127.0.0.1:{port}", "m", retry=FAST) as client:
        with pytest.raises(aiohttp.ClientConnectionError):
            await client.rollout([1])


async def test_a_connection_dropped_mid_answer_is_retried() -> None:
    calls = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:  # headers, half a body, then the connection goes
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"choices": [')
            assert request.transport is not None
            request.transport.close()
            return response
        return web.json_response(answer())

    runner, url = await fake_frontend(handler)
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            assert (await client.rollout([1])).token_ids == [4]
        assert calls == 2
    finally:
        await runner.cleanup()


async def test_a_cancelled_rollout_says_so() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "choices": [{"index": 0, "text": "", "finish_reason": "cancelled"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
            }
        )

    runner, url = await fake_frontend(handler)
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            with pytest.raises(driver.RolloutCancelledError, match="cancelled before it finished"):
                await client.rollout([1])
    finally:
        await runner.cleanup()


def test_retry_policy_backoff_grows_with_jitter_and_is_capped() -> None:
    policy = driver.RetryPolicy(attempts=5, initial_s=1.0, max_s=4.0, jitter=0.2)
    for attempt, base in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0)):
        delays = {policy.delay(attempt) for _ in range(50)}
        assert all(0.8 * base <= d <= 1.2 * base for d in delays)
        assert len(delays) > 1  # jittered
    with pytest.raises(ValueError):
        driver.RetryPolicy(attempts=0)
