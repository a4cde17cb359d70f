"""Rollouts and completions through the real Dynamo frontend, bridge and engine server."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
from tokenizers import Tokenizer

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import load, prompt_of
from harness.http import http_json, open_sse_stream
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver
from tests.e2e.e2e_stack import LONG_MODEL, assert_same, bridged_rollout, direct_rollout

pytestmark = pytest.mark.dynamo


@pytest.mark.parametrize("greedy", [True, False])
async def test_rollout_identical_to_the_engine_server(stack: Stack, greedy: bool) -> None:
    prompt = prompt_of(21, seed=1)
    rid = f"same-{greedy}"
    result = await bridged_rollout(stack, prompt, greedy=greedy, max_tokens=24, request_id=rid)
    direct = direct_rollout(stack, prompt, greedy=greedy, request_id=rid, max_new_tokens=24)
    assert_same(result, direct)
    assert result.routed_experts is not None and result.routed_experts.shape[1:] == (4, 2)
    assert result.request_id == rid


async def test_rollout_with_stop_string_kept_in_output(stack: Stack) -> None:
    prompt = prompt_of(9, seed=2)
    full = direct_rollout(stack, prompt, greedy=True, request_id="probe", max_new_tokens=40)
    tokenizer = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    text = tokenizer.decode(list(full.token_ids)[:20])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    result = await bridged_rollout(stack, prompt, greedy=True, stop_strings=[stop], max_tokens=40)
    direct = direct_rollout(
        stack, prompt, greedy=True, request_id="probe2", stop_strings=(stop,), max_new_tokens=40
    )
    assert_same(result, direct)
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert stop in tokenizer.decode(result.token_ids)


async def test_rollout_ending_on_eos_comes_back_whole(stack: Stack) -> None:
    """The frontend hides an EOS token it decodes; the rollout chunk is passed through
    undecoded, so the EOS stays, and usage counts it."""
    channel, stub = stack.engine_stub()
    with channel:
        eos = set(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).eos_token_ids)
    for seed in range(30):
        prompt = prompt_of(8, seed=100 + seed)
        direct = direct_rollout(stack, prompt, greedy=True, request_id=f"eos-{seed}")
        if direct.matched_stop.WhichOneof("match") == "token_id":
            break
    else:
        pytest.fail("no greedy rollout ended on EOS")
    result = await bridged_rollout(stack, prompt, greedy=True)
    assert_same(result, direct)
    assert result.token_ids[-1] in eos and result.finish_reason == "stop"
    status, body = http_json(
        f"{stack.base_url}/v1/completions",
        driver.build_rollout_body(stack.model, prompt, greedy=True),
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == len(direct.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_http_usage_is_the_rollouts(stack: Stack, stream: bool) -> None:
    """Dynamo's frontend counts usage from the chunks' tokens: a rollout reports its
    real prompt and completion counts (frontend metrics and aiperf read them), and
    its tokens still come back exactly, whatever stop strings the text holds."""
    for seed in range(6):
        prompt = prompt_of(10 + seed, seed=300 + seed)
        direct = direct_rollout(stack, prompt, greedy=True, request_id=f"u{seed}{stream}")
        body = driver.build_rollout_body(stack.model, prompt, greedy=True)
        usage: dict[str, Any] | None = None
        rollout: driver.RolloutResult
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            events = sse_events(stack, "/v1/completions", body)
            usage = next(e["usage"] for e in events if e.get("usage"))
            # The one content event carries the rollout whole.
            data = next(e for e in events if e.get("choices") and e.get("nvext"))
            rollout = driver.parse_rollout_response(data)
            assert rollout.token_ids == list(direct.token_ids)
        else:
            status, answer = http_json(f"{stack.base_url}/v1/completions", body)
            assert status == 200, answer
            rollout = driver.parse_rollout_response(answer)
            assert_same(rollout, direct)
            usage = answer["usage"]
        assert usage is not None
        # The prompt's cached tokens are reported even when 0 (aiperf reads an
        # absent count as a server that does not report them).
        details = usage.pop("prompt_tokens_details", None)
        cached = rollout.usage["cached_prompt_tokens"]
        assert details is not None and details["cached_tokens"] == cached, details
        assert usage == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(direct.token_ids),
            "total_tokens": len(prompt) + len(direct.token_ids),
        }, (usage, direct.usage)


async def test_max_tokens_zero_generates_nothing(stack: Stack) -> None:
    """The frontend refuses max_tokens 0, so the driver answers it itself, as the engine would."""
    result = await bridged_rollout(stack, prompt_of(5, seed=3), max_tokens=0)
    direct = direct_rollout(
        stack, prompt_of(5, seed=3), greedy=False, request_id="zero", max_new_tokens=0
    )
    assert_same(result, direct)
    assert (result.token_ids, result.logprobs, result.truncated) == ([], [], False)
    assert result.finish_reason == "length"


async def test_without_max_tokens_the_engine_default_applies(stack: Stack) -> None:
    result = await bridged_rollout(stack, prompt_of(5, seed=4), greedy=True)
    direct = direct_rollout(stack, prompt_of(5, seed=4), greedy=True, request_id="default")
    assert_same(result, direct)


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        ('rollout:{"greedy":"yes"}', "'greedy' must be a boolean"),
        ('rollout:{"top_p":0.5}', "unknown keys ['top_p']"),
        ('rolout:{"greedy":true}', "unknown request kind 'rolout'"),
    ],
)
def test_bad_annotation_is_http_400_with_its_message(
    stack: Stack, annotation: str, message: str
) -> None:
    body = {
        "model": stack.model,
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "nvext": {"annotations": [annotation], "extra_fields": ["engine_data"]},
    }
    status, answer = http_json(f"{stack.base_url}/v1/completions", body)
    assert status == 400, answer
    assert message in json.dumps(answer, ensure_ascii=False).replace('\\"', '"')


async def test_engine_invalid_argument_is_http_400(stack: Stack) -> None:
    with pytest.raises(driver.RolloutHTTPError) as info:
        await bridged_rollout(stack, [5, 99999], max_tokens=2)  # outside the vocabulary
    assert info.value.status == 400 and info.value.message


def test_rollout_text_when_asked(stack: Stack) -> None:
    """``rollout:{"text": true}``: the decoded completion in ``choices[0].text`` too
    (OpenAI clients, aiperf), the tokens unchanged; a bad value is HTTP 400."""
    tokenizer = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    prompt = prompt_of(12, seed=400)
    direct = direct_rollout(stack, prompt, greedy=True, request_id="text-1", max_new_tokens=20)
    body = driver.build_rollout_body(stack.model, prompt, greedy=True, max_tokens=20, text=True)
    status, answer = http_json(f"{stack.base_url}/v1/completions", body)
    assert status == 200, answer
    assert_same(driver.parse_rollout_response(answer), direct)
    text = answer["choices"][0]["text"]
    assert text and text == tokenizer.decode(list(direct.token_ids), skip_special_tokens=True)
    bad = driver.build_rollout_body(stack.model, prompt, greedy=True, max_tokens=2)
    bad["nvext"]["annotations"] = ['rollout:{"text": "yes"}']
    status, answer = http_json(f"{stack.base_url}/v1/completions", bad)
    assert status == 400 and "'text' must be a boolean" in json.dumps(answer)


def sse_events(stack: Stack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's events, read to its end."""
    status, answer = 0, None
    req = urllib.request.Request(
        f"{stack.base_url}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=30) as resp:
        status = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                answer = json.loads(line[5:])
                events.append(answer)
    assert status == 200
    return events


def test_completions_stream_their_text_and_carry_logprobs(stack: Stack) -> None:
    events = sse_events(
        stack,
        "/v1/completions",
        {
            "model": stack.model,
            "prompt": "Hello there",
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
            "logprobs": 1,
        },
    )
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    finishes = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
    assert text and finishes[-1] == "length"
    status, body = http_json(
        f"{stack.base_url}/v1/completions",
        {
            "model": stack.model,
            "prompt": "Hello there",
            "max_tokens": 8,
            "ignore_eos": True,
            "logprobs": 2,
        },
    )
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert body["usage"]["completion_tokens"] == 8
    assert len(logprobs["token_logprobs"]) == 8 and len(logprobs["top_logprobs"]) == 8


def test_chat_completions_are_answered_plain_and_streamed(stack: Stack) -> None:
    status, body = http_json(
        f"{stack.base_url}/v1/chat/completions",
        {
            "model": stack.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    events = sse_events(
        stack,
        "/v1/chat/completions",
        {
            "model": stack.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
        },
    )
    assert events


def engine_running(stack: Stack, model: str) -> int:
    now = load(stack.address(model))
    return now.running_requests + now.waiting_requests + now.registered_requests


def bridge_aborts(stack: Stack) -> int:
    """How often the long model's bridge stopped an engine request early (an Abort RPC
    or a cancelled call, whichever Dynamo's order of events made it do)."""
    text = stack.group.get(f"bridge-{LONG_MODEL}").log_path.read_text(errors="replace")
    return text.count("ABORT_OUTCOME_") + text.count("engine call cancelled")


def test_client_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    aborts = bridge_aborts(stack)
    body = {"model": LONG_MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "stream": True}
    with open_sse_stream(stack.base_url, body, timeout=10):
        assert engine_running(stack, LONG_MODEL) >= 1
    started = time.monotonic()
    wait_until(lambda: engine_running(stack, LONG_MODEL) == 0, 10, "engine request aborted")
    # 3000 tokens at 2 ms per step would take 6 s: it was aborted, not finished.
    assert time.monotonic() - started < 4
    wait_until(lambda: bridge_aborts(stack) > aborts, 5, "the bridge's abort")


def test_stop_string_ends_the_engine_request(stack: Stack) -> None:
    """Dynamo 1.6.1 passes OpenAI ``stop`` to the engine (stop_conditions.stop) and also
    cuts the text itself; either way the engine request must end there, not run on."""
    base = {"model": LONG_MODEL, "prompt": "The stop test", "temperature": 0.0}
    status, body = http_json(f"{stack.base_url}/v1/completions", {**base, "max_tokens": 12})
    assert status == 200, body
    text = body["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    started = time.monotonic()
    status, body = http_json(
        f"{stack.base_url}/v1/completions", {**base, "max_tokens": 3000, "stop": [stop]}
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[: text.index(stop)]
    wait_until(lambda: engine_running(stack, LONG_MODEL) == 0, 5, "engine request ended")
    # 3000 tokens at 2 ms per step would take 6 s.
    assert time.monotonic() - started < 4
