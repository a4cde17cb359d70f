"""Item 7: bad input through the whole stack (HTTP -> frontend -> bridge -> engine
server). Each case gets a 4xx whose message names the problem, wherever along
the stack it is caught, and every process keeps serving.

The engine server runs with a vocabulary (900) smaller than the tokenizer's
(1024), so ids 900-1023 pass Dynamo's own token-id check and reach the engine's.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harness.engine import idle, wait_load
from harness.http import http_json, post
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver
from tests.faults.faults_common import LONG_SIM_ARGS

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-bad-input"
VOCAB = 900


def rollout_body(prompt: list[int] | None = None, spec: Any = None, **extra: Any) -> dict:
    body = driver.build_rollout_body(MODEL, prompt or [5, 6, 7], greedy=True, max_tokens=4)
    if spec is not None:
        body["nvext"]["annotations"] = spec if isinstance(spec, list) else [spec]
    body.update(extra)
    return body


def completion_body(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **fields}


def rollout_spec(**spec: Any) -> str:
    return "rollout:" + json.dumps(spec)


# (id, body, expected status, words the message must contain)
CASES: list[tuple[str, Any, int, tuple[str, ...]]] = [
    # Token ids
    ("out-of-vocab-engine", rollout_body([5, 950]), 400, ("950", "vocab")),
    ("out-of-vocab-completion", completion_body(prompt=[5, 960]), 400, ("960", "vocab")),
    ("out-of-tokenizer-vocab", completion_body(prompt=[5, 999_999]), 400, ("Invalid request",)),
    ("negative-token-id", completion_body(prompt=[5, -3]), 400, ("Prompt",)),
    ("empty-prompt", completion_body(prompt=[]), 400, ("Prompt", "empty")),
    ("empty-prompt-rollout", rollout_body(prompt=[]) | {"prompt": []}, 400, ("empty",)),
    # (A rollout past the context generates nothing, as on NeMo RL's native path.)
    (
        "over-context",
        completion_body(prompt=[5] * 5000),
        400,
        ("5000 tokens", "context length 4096"),
    ),
    # Annotations
    ("annotation-bad-json", rollout_body(spec="rollout:{not json"), 400, ("not valid JSON",)),
    ("annotation-unknown-kind", rollout_body(spec="frobnicate:{}"), 400, ("frobnicate",)),
    ("annotation-unknown-key", rollout_body(spec=rollout_spec(foo=1)), 400, ("foo",)),
    ("annotation-wrong-type", rollout_body(spec=rollout_spec(greedy="yes")), 400, ("greedy",)),
    ("annotation-twice", rollout_body(spec=["rollout:{}", "rollout:{}"]), 400, ("more than one",)),
    ("annotation-not-a-string", rollout_body(spec=[5]), 400, ("expected a string",)),
    ("empty-request-id", rollout_body(spec=rollout_spec(request_id="")), 400, ("request_id",)),
    # JSON types and sizes
    ("prompt-wrong-type", completion_body(prompt={"a": 1}), 400, ("Prompt",)),
    ("missing-prompt", {"model": MODEL, "max_tokens": 4}, 400, ("prompt",)),
    ("max-tokens-string", completion_body(max_tokens="ten"), 400, ("ten",)),
    ("max-tokens-negative", completion_body(max_tokens=-5), 400, ("-5",)),
    ("max-tokens-huge", completion_body(max_tokens=10**12), 400, ("1000000000000",)),
    ("max-tokens-huge-rollout", rollout_body(max_tokens=2**31 + 5), 400, ("Max tokens",)),
    ("temperature-negative", completion_body(temperature=-1), 400, ("Temperature",)),
    ("top-p-over-1", completion_body(top_p=2.0), 400, ("Top_p",)),
    ("top-k-negative", completion_body(top_k=-5), 400, ("Top_k",)),
    ("logprobs-too-many", completion_body(logprobs=1000), 400, ("1000",)),
    ("n-over-1", completion_body(n=2), 400, ("n > 1",)),
    # Stop strings
    (
        "too-many-stop-strings-rollout",
        rollout_body(spec=rollout_spec(stop_strings=[f"s{i}" for i in range(100)])),
        400,
        ("100 stop strings", "limit of 32"),
    ),
    (
        "too-many-stop-strings",
        completion_body(stop=[f"s{i}" for i in range(100)]),
        400,
        ("32 stop sequences",),
    ),
    (
        "stop-string-too-long",
        rollout_body(spec=rollout_spec(stop_strings=["x" * 3000])),
        400,
        ("3000 characters", "limit of 1024"),
    ),
    ("rollout-with-stop", rollout_body(stop=["x"]), 400, ("stop_strings", "'stop'")),
    # Oversized payload (a ~20 MB body) and unknown model
    ("oversized-payload", completion_body(prompt=[5] * 3_000_000), 400, ("3000000 tokens",)),
    ("unknown-model", completion_body(model="no-such-model"), 404, ("Model not found",)),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("bad-input")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        _, address = stack.start_engine("engine", *LONG_SIM_ARGS, "--vocab-size", str(VOCAB))
        stack.start_bridge("bridge", address)
        stack.start_frontend()
        stack.wait_serving()
        yield stack


def message_of(body: Any) -> str:
    return str(body.get("message", body)) if isinstance(body, dict) else str(body)


@pytest.mark.parametrize(
    ("body", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_a_4xx_naming_the_problem(
    stack: Stack, body: Any, status: int, words: tuple[str, ...]
) -> None:
    got, answer = http_json(f"{stack.base_url}/v1/completions", body)
    message = message_of(answer)
    assert got == status, (got, answer)
    for word in words:
        assert word in message, (word, message)
    for proc in stack.procs:
        proc.check_alive()


def test_a_malformed_json_body_is_answered_400(stack: Stack) -> None:
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=b'{"model": "x", "prompt": [1,',
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
    assert "JSON" in err.value.read().decode()


async def test_duplicate_request_id_is_refused_while_running(stack: Stack) -> None:
    spec = rollout_spec(greedy=True, request_id="dup-1")
    first_body = rollout_body(spec=spec, max_tokens=100)
    url = f"{stack.base_url}/v1/completions"
    address = stack.engines[0].address
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, url, first_body))
        await asyncio.to_thread(wait_load, address, lambda load: load.running_requests >= 1, 10)
        second = await post(session, url, rollout_body(spec=spec))
        assert second.status == 400, (second.status, second.body)
        assert "'dup-1' is already running" in message_of(second.body)
        assert (await first).status == 200


def test_everything_still_serves(stack: Stack) -> None:
    """After all the bad input: a rollout works and the engine holds no request."""
    status, body = http_json(f"{stack.base_url}/v1/completions", rollout_body())
    assert status == 200, body
    assert len(driver.parse_rollout_response(body).token_ids) == 4
    wait_load(stack.engines[0].address, idle, 5)
    for proc in stack.procs:
        proc.check_alive()
