"""Driver reassembly: bridge chunk -> JSON (as the frontend returns it) -> RolloutResult."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from bridge import codec
from engine_contract.tensors import TENSOR_DTYPES
from engine_contract.v1 import engine_pb2 as pb
from rl_client import driver, wire
from rl_client.annotation import RolloutSpec
from tests.bridge.bridge_fakes import fake_frontend, frontend_body

# The routed-experts dtypes the wire allows, as the contract numbers them.
PB_DTYPES = {name: TENSOR_DTYPES[name] for name in wire.DTYPE_ITEMSIZE}


def random_doubles(n: int, seed: int = 0) -> list[float]:
    """Awkward finite doubles: random bit patterns, float32 values, tiny and huge."""
    rng = random.Random(seed)
    out = [-0.0, -5e-324, -1.7976931348623157e308, -1e-300, -0.1, -1 / 3]
    while len(out) < n:
        bits = rng.getrandbits(64)
        x = struct.unpack("<d", struct.pack("<Q", bits))[0]
        if x == x and abs(x) != float("inf"):
            out.append(-abs(x))
        f32 = struct.unpack("<f", struct.pack("<f", -rng.random() * 20))[0]
        out.append(f32)
    return out[:n]


def test_logprobs_survive_json_bit_exactly() -> None:
    lps = random_doubles(5000)
    resp = pb.RolloutResponse(
        request_id="r",
        token_ids=list(range(len(lps))),
        logprobs=lps,
        finish_reason=pb.FINISH_REASON_LENGTH,
        truncated=True,
    )
    result = driver.parse_rollout_response(frontend_body(resp))
    assert [struct.pack("<d", x) for x in result.logprobs] == [struct.pack("<d", x) for x in lps]
    assert result.token_ids == list(range(len(lps)))
    assert result.truncated is True and result.finish_reason == "length"


def test_non_finite_logprobs_arrive_as_the_floor() -> None:
    resp = pb.RolloutResponse(token_ids=[1, 2, 3], logprobs=[float("-inf"), float("nan"), -1.0])
    result = driver.parse_rollout_response(frontend_body(resp))
    assert result.logprobs == [wire.LOGPROB_FLOOR, wire.LOGPROB_FLOOR, -1.0]


@pytest.mark.parametrize("dtype", list(PB_DTYPES))
def test_routed_experts_keep_dtype_shape_and_bytes(dtype: str) -> None:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    experts = rng.integers(info.min, info.max, size=(5, 3, 2), dtype=dtype, endpoint=True)
    if info.min < 0:
        experts[0, 0, 0] = -1  # R3's missing-route sentinel
    resp = pb.RolloutResponse(
        request_id="r",
        token_ids=[1, 2],
        logprobs=[-1.0, -2.0],
        finish_reason=pb.FINISH_REASON_STOP,
        matched_stop=pb.StopMatch(stop_string="\n"),
        usage=pb.Usage(prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=1),
        routed_experts=pb.RoutedExperts(
            data=experts.astype(f"<{experts.dtype.str[1:]}").tobytes(),
            dtype=PB_DTYPES[dtype],
            shape=[5, 3, 2],
        ),
        r3_stats=pb.R3Stats(actual_routes=5, expected_routes=5),
        instance_id="i",
    )
    result = driver.parse_rollout_response(frontend_body(resp))
    assert result.routed_experts is not None
    array = result.routed_experts.to_numpy()
    assert array.dtype == np.dtype(dtype) and array.shape == (5, 3, 2)
    np.testing.assert_array_equal(array, experts)
    assert result.r3_stats == {
        "actual_routes": 5,
        "expected_routes": 5,
        "missing_routes": 0,
        "surplus_routes": 0,
    }
    assert result.stop_reason == "\n" and result.finish_reason == "stop"
    assert result.usage == {"prompt_tokens": 4, "completion_tokens": 2, "cached_prompt_tokens": 1}
    assert result.instance_id == "i" and result.worker_id == {"decode_worker_id": 7}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["nvext"].pop("engine_data"), "no nvext.engine_data.rollout"),
        (lambda d: d["nvext"]["engine_data"]["rollout"].update(version=99), "version 99"),
        (lambda d: d["nvext"]["engine_data"]["rollout"].update(extra=1), "unknown keys"),
        (
            lambda d: d["nvext"]["engine_data"]["rollout"].update(
                logprobs=wire.encode_logprobs([-0.5])
            ),
            "1 logprobs for 2",
        ),
        (
            lambda d: d["nvext"]["engine_data"]["rollout"].update(logprobs="AAAA"),
            "not whole float64s",
        ),
        (
            lambda d: d["nvext"]["engine_data"]["rollout"].update(
                routed_experts={"dtype": "int16", "shape": [3], "data": "AAA="}
            ),
            "needs 6",
        ),
        (
            lambda d: d["nvext"]["engine_data"]["rollout"].update(
                routed_experts={"dtype": "float32", "shape": [1], "data": "AAAAAA=="}
            ),
            "dtype",
        ),
    ],
)
def test_malformed_answers_rejected(mutate: Any, message: str) -> None:
    body = frontend_body(pb.RolloutResponse(token_ids=[1, 2], logprobs=[-1.0, -2.0]))
    mutate(body)
    with pytest.raises(driver.WireError, match=message):
        driver.parse_rollout_response(body)


def test_the_rollout_body_carries_the_annotation_the_bridge_parses() -> None:
    body = driver.build_rollout_body(
        "m", [1, 2], greedy=True, stop_strings=["\n"], max_tokens=8, request_id="r1", worker_id=True
    )
    assert body == {
        "model": "m",
        "prompt": [1, 2],
        "stream": False,
        "max_tokens": 8,
        "nvext": {
            "annotations": ['rollout:{"greedy":true,"stop_strings":["\\n"],"request_id":"r1"}'],
            "extra_fields": ["engine_data", "worker_id"],
        },
    }
    # The bridge reads back exactly what the driver wrote.
    spec = codec.parse_request_kind(body["nvext"]["annotations"])
    assert spec == RolloutSpec(greedy=True, stop_strings=("\n",), request_id="r1")
    assert "max_tokens" not in driver.build_rollout_body("m", [1])


async def test_client_round_trip_and_http_errors() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body["prompt"] == [0]:
            return web.json_response(
                {"error": {"message": "rollout spec has unknown keys", "code": 400}}, status=400
            )
        if body["prompt"] == [9]:
            return web.Response(status=503, text="no workers")
        resp = pb.RolloutResponse(
            request_id="x",
            token_ids=[3],
            logprobs=[-0.5],
            finish_reason=pb.FINISH_REASON_LENGTH,
            truncated=True,
        )
        return web.json_response(frontend_body(resp))

    runner, url = await fake_frontend(handler)
    try:
        once = driver.RetryPolicy(attempts=1)
        async with driver.RolloutClient(url, "m", retry=once) as client:
            result = await client.rollout([1, 2], max_tokens=1)
            assert result.token_ids == [3] and result.logprobs == [-0.5] and result.truncated
            assert seen[0]["max_tokens"] == 1
            # A zero budget is answered without asking (the frontend refuses max_tokens 0).
            nothing = await client.rollout([1, 2, 3], max_tokens=0)
            assert len(seen) == 1
            assert (nothing.token_ids, nothing.truncated, nothing.finish_reason) == (
                [],
                False,
                "length",
            )
            assert nothing.usage["prompt_tokens"] == 3
            with pytest.raises(driver.RolloutHTTPError, match="unknown keys") as info:
                await client.rollout([0])
            assert info.value.status == 400
            with pytest.raises(driver.RolloutHTTPError, match="no workers") as info:
                await client.rollout([9])
            assert info.value.status == 503
    finally:
        await runner.cleanup()


def test_driver_needs_neither_dynamo_nor_grpc() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('dynamo', 'grpc', 'torch', 'vllm', 'google'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rl_client.driver, rl_client.batch\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
