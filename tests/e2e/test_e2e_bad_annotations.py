"""Issue 12, items 5 and 8, through the real frontend, bridge and engine server:
rollout annotations nested past the JSON parser's depth and strings holding lone
surrogates are HTTP 400 naming the field (not a 500), a rollout asking for more
than one choice is 400, and everything keeps serving.

The bodies are sent as raw JSON text: the annotation holds the escape sequence
``\\ud800`` itself, which Dynamo's frontend passes on as text and the bridge's
JSON parser turns into a lone surrogate (no UTF-8 form, so no protobuf string).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from harness.stack import Stack
from rl_client import driver
from tests.e2e.e2e_stack import bridged_rollout

pytestmark = pytest.mark.dynamo

DEPTH = 5000


def post_raw(stack: Stack, text: str) -> tuple[int, str]:
    """POST ``text`` as the /v1/completions body; (status, body text)."""
    req = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=text.encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def rollout_text(stack: Stack, annotation_json: str, **extra: Any) -> str:
    """A rollout body whose annotation is ``annotation_json`` (a JSON string literal,
    quotes included), written out by hand so that escapes reach the bridge as is."""
    fields = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
    return (
        f'{{"model": {json.dumps(stack.model)}, "prompt": [5, 6, 7], "max_tokens": 4'
        f'{fields}, "nvext": {{"annotations": [{annotation_json}], '
        f'"extra_fields": ["engine_data"]}}}}'
    )


CASES = [
    pytest.param(
        '"rollout:' + "[" * DEPTH + "]" * DEPTH + '"',
        ("rollout spec", "nested too deeply"),
        id="deep-lists",
    ),
    pytest.param(
        '"rollout:' + '{\\"a\\":' * DEPTH + "1" + "}" * DEPTH + '"',
        ("rollout spec", "nested too deeply"),
        id="deep-objects",
    ),
    pytest.param(
        '"rollout:{\\"stop_strings\\":[\\"\\\\ud800\\"]}"',
        ("stop_strings", "surrogate"),
        id="lone-surrogate-stop",
    ),
    pytest.param(
        '"rollout:{\\"request_id\\":\\"x\\\\udfff\\"}"',
        ("request_id", "surrogate"),
        id="lone-surrogate-id",
    ),
]


@pytest.mark.parametrize(("annotation", "words"), CASES)
async def test_bad_annotation_is_400_naming_the_field(
    stack: Stack, annotation: str, words: tuple[str, ...]
) -> None:
    body = rollout_text(stack, annotation)
    json.loads(body)  # well-formed JSON: what is wrong is inside the annotation
    status, text = post_raw(stack, body)
    assert status == 400, (status, text[:500])
    assert len(text) < 2000, text[:500]
    for word in words:
        assert word in text, text
    await assert_still_serving(stack)


def test_the_surrogates_reach_the_bridge_as_lone_surrogates() -> None:
    """What the cases above send: the bridge's parser sees a lone surrogate."""
    outer = json.loads('["rollout:{\\"stop_strings\\":[\\"\\\\ud800\\"]}"]')[0]
    assert outer == 'rollout:{"stop_strings":["\\ud800"]}'
    assert json.loads(outer.removeprefix("rollout:"))["stop_strings"] == ["\ud800"]


@pytest.mark.parametrize(("field", "value"), [("n", 3), ("best_of", 3)])
async def test_rollout_with_more_than_one_choice_is_400(
    stack: Stack, field: str, value: int
) -> None:
    body = driver.build_rollout_body(stack.model, [5, 6, 7], greedy=True, max_tokens=4)
    body[field] = value
    status, text = post_raw(stack, json.dumps(body))
    assert status == 400, (status, text[:500])
    assert "one choice" in text and field in text, text
    await assert_still_serving(stack)


async def assert_still_serving(stack: Stack) -> None:
    result = await bridged_rollout(stack, [5, 6, 7, 8], greedy=True, max_tokens=3)
    assert len(result.token_ids) == 3 or result.finish_reason == "stop", result
    for proc in stack.procs:
        proc.check_alive()
