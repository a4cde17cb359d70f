"""The refit cycle through the real stack: frontend -> bridge -> engine server.

The bridge's system port serves Dynamo's RL admin routes as ``dynamo.vllm
--enable-rl`` does; a trainer drives them over HTTP (here as ``RefitClient``
and as raw calls, errors included) while rollouts run through the frontend.
The sim engine's weights are the tiny model's checkpoint: a refit to checkpoint
B must answer exactly as a sim engine started on B does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir
from harness.engine import load, prompt_of
from harness.env import frontend_maps_worker_errors
from harness.http import http_json
from harness.nemo_rl import ready_fleet
from harness.ports import free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack, registered_workers
from harness.waits import wait_until
from rl_client import driver
from rl_client.committed import CheckpointSource, CommittedWeights
from rl_client.refit import RefitClient
from rl_client.refit_report import Outcome, RefitError, Served

pytestmark = pytest.mark.dynamo

MODEL = "tiny-refit"
SIM_ARGS = ("--eos-rate", "0", "--decode-step-ms", "4", "--block-size", "16")
NOT_PAUSED = (
    "Worker must be paused via pause_generation() before updating weights. Call "
    "pause_generation() first, then update, then resume_generation()."
)


@dataclass
class RefitStack:
    stack: Stack
    admin: str  # the bridge's system URL
    fresh_b: pb_grpc.EngineServiceStub  # a sim engine server started on checkpoint B
    weights_b: Path


@pytest.fixture(scope="module")
def refit_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[RefitStack]:
    root = tmp_path_factory.mktemp("refit-stack")
    weights_b = tiny_weights_dir(1)
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        _, address = stack.start_engine("engine", *SIM_ARGS)
        system_port = free_system_port()
        stack.start_bridge("bridge", address, "--enable-rl", DYN_SYSTEM_PORT=str(system_port))
        _, fresh_address = group.engine_server(
            "fresh-b", "--model", str(weights_b), "--served-model-name", MODEL, *SIM_ARGS
        )
        stack.start_frontend("--router-mode", "kv")
        stack.wait_serving(timeout=60)
        with grpc.insecure_channel(fresh_address) as channel:
            yield RefitStack(
                stack,
                f"http://127.0.0.1:{system_port}",
                pb_grpc.EngineServiceStub(channel),
                weights_b,
            )


def route(rs: RefitStack, name: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    if raw is None:
        return http_json(f"{rs.admin}/engine/{name}", body if body is not None else {})
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{rs.admin}/engine/{name}", data=raw)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ok(rs: RefitStack, name: str, body: Any = None) -> dict[str, Any]:
    status, answer = route(rs, name, body)
    assert status == 200 and answer.get("status") == "ok", (name, status, answer)
    return answer


def error(rs: RefitStack, name: str, body: Any = None) -> str:
    status, answer = route(rs, name, body)
    assert status == 200 and answer.get("status") == "error", (name, status, answer)
    return str(answer["message"])


def same(result: driver.RolloutResult, reference: pb.RolloutResponse) -> None:
    assert result.token_ids == list(reference.token_ids)
    assert [struct.pack("<d", x) for x in result.logprobs] == [
        struct.pack("<d", x) for x in reference.logprobs
    ]


async def rollouts(
    rs: RefitStack, prompts: list[list[int]], **kw: Any
) -> list[driver.RolloutResult]:
    async with driver.RolloutClient(rs.stack.base_url, MODEL, timeout_s=60) as client:
        return list(
            await asyncio.gather(
                *(
                    client.rollout(p, greedy=True, max_tokens=kw.get("max_tokens", 16))
                    for p in prompts
                )
            )
        )


def router_hit_rate(rs: RefitStack, prompt: list[int]) -> float:
    """The KV router's overlap score for this worker, as the frontend reports it."""
    status, body = http_json(
        f"{rs.stack.base_url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "nvext": {"extra_fields": ["timing"]}},
    )
    assert status == 200, body
    return float(body["nvext"]["timing"]["kv_hit_rate"])


def engine_load(rs: RefitStack) -> pb.GetLoadResponse:
    return load(rs.stack.address())


# -- the routes, as a dynamo.vllm RL client calls them ---------------------------


def test_every_route_answers_as_dynamo_vllm(refit_stack: RefitStack) -> None:
    rs = refit_stack
    assert ok(rs, "liveness_probe") == {"status": "ok", "alive": True}
    # dynamo.vllm's keys, then ours: the label serving, the count of weight changes,
    # why the weights are not whole under it and whether an update is open (revision 12).
    assert ok(rs, "get_weight_version") == {
        "status": "ok",
        "version": None,
        "version_declared": False,
        "serving": "default",
        "weight_changes": 0,
        "weights_mixed": "",
        "weight_update_open": False,
    }
    # Bodies: GET and empty bodies are {}; not an object, an error answer; not JSON, 400.
    status, answer = http_json(f"{rs.admin}/engine/get_weight_version")
    assert status == 200 and answer["status"] == "ok"
    assert error(rs, "pause_generation", [1, 2]) == "request body must be a JSON object"
    assert route(rs, "pause_generation", raw=b"{not json")[0] == 400
    assert error(rs, "pause_generation", {"mode": "bogus"}) == (
        "Invalid mode 'bogus'; expected keep|wait|abort"
    )
    # Updates are refused unless paused, in dynamo.vllm's words.
    assert error(rs, "update_weights_from_disk", {"model_path": str(rs.weights_b)}) == NOT_PAUSED
    assert error(rs, "update_weights_from_distributed", {}) == NOT_PAUSED
    ok(rs, "pause_generation", {"mode": "wait"})
    try:
        assert error(rs, "update_weights_from_disk", {}) == "Missing 'model_path' in body"
        # No version declared: dynamo.vllm's "unknown", and the label is kept.
        same = {"model_path": str(rs.stack.model_dir)}
        assert ok(rs, "update_weights_from_disk", same) == {
            "status": "ok",
            "version": "unknown",
            "version_declared": False,
            "weight_changes": 1,
        }
        # A writer fenced on a count the engine moved past is refused.
        assert "a stale writer: it expected weight change 0, but the engine is at 1" in error(
            rs, "update_weights_from_disk", {**same, "expect_weight_changes": 0}
        )
        assert "'expect_weight_changes' must be a count" in error(
            rs, "set_weight_version", {"weight_version": "x", "expect_weight_changes": -1}
        )
        assert ok(rs, "get_weight_version")["version_declared"] is False
    finally:
        ok(rs, "resume_generation")
    assert error(rs, "update_weights_from_distributed", {"allow_unpaused": "yes"}) == (
        "'allow_unpaused' must be a boolean"
    )
    assert "cannot reset the prefix cache" in error(
        rs, "update_weights_from_distributed", {"allow_unpaused": True}
    )
    assert "not implemented" in error(rs, "update_weights_from_tensor", {"names": []})
    assert "not supported" in error(rs, "init_weights_update_group", {"master_address": "x"})
    assert "not supported" in error(rs, "destroy_weights_update_group")
    assert error(rs, "set_weight_version", {}) == "Missing 'weight_version' in body"
    assert error(rs, "abort_request", {}) == "Missing 'request_id' in body"
    assert ok(rs, "abort_request", {"request_id": "nobody"}) == {
        "status": "ok",
        "request_id": "nobody",
    }
    assert ok(rs, "flush_cache") == {"status": "ok", "message": "Cache flushed"}
    # Versions: any JSON scalar, as dynamo.vllm takes them.
    assert ok(rs, "set_weight_version", {"weight_version": 1, "expect_weight_changes": 1}) == {
        "status": "ok",
        "version": 1,
        "weight_changes": 2,
    }
    assert ok(rs, "get_weight_version") == {
        "status": "ok",
        "version": "1",
        "version_declared": True,
        "serving": "1",
        "weight_changes": 2,
        "weights_mixed": "",
        "weight_update_open": False,
    }
    # The routes share the port with Dynamo's own: /health, /metrics, unknown routes.
    assert http_json(f"{rs.admin}/health")[0] == 200
    status, _ = http_json(f"{rs.admin}/metrics")
    assert status == 200
    status, answer = http_json(f"{rs.admin}/engine/no_such_route", {})
    assert "not found" in json.dumps(answer).lower(), (status, answer)


def test_a_bad_checkpoint_is_refused_and_the_old_weights_keep_serving(
    refit_stack: RefitStack, tmp_path: Path
) -> None:
    rs = refit_stack
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(_bad_checkpoint(rs.weights_b / "model.safetensors"))
    before = asyncio.run(rollouts(rs, [prompt_of(20, 7)]))
    version = ok(rs, "get_weight_version")
    ok(rs, "pause_generation", {"mode": "wait", "clear_cache": True})
    try:
        message = error(
            rs, "update_weights_from_disk", {"model_path": str(bad), "weight_version": "bad"}
        )
        assert "old weights still serve" in message and "shape" in message.lower(), message
        missing = error(rs, "update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
        assert "does not exist" in missing
    finally:
        ok(rs, "resume_generation")
    assert ok(rs, "get_weight_version") == version
    after = asyncio.run(rollouts(rs, [prompt_of(20, 7)]))
    assert after[0].token_ids == before[0].token_ids


def _bad_checkpoint(source: Path) -> bytes:
    """The checkpoint with its first tensor's first dimension doubled."""
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    name = next(k for k in header if k != "__metadata__")
    out_header: dict[str, Any] = {}
    chunks = []
    position = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        blob = body[start:end] * (2 if key == name else 1)
        shape = list(entry["shape"])
        if key == name:
            shape[0] *= 2
        out_header[key] = {
            "dtype": entry["dtype"],
            "shape": shape,
            "data_offsets": [position, position + len(blob)],
        }
        chunks.append(blob)
        position += len(blob)
    encoded = json.dumps(out_header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks)


# -- a refit step, as the trainer-side client runs it --------------------------------


async def test_refit_serves_exactly_what_an_engine_started_on_b_serves(
    refit_stack: RefitStack,
) -> None:
    rs = refit_stack
    prompts = [prompt_of(40 + i, 20 + i) for i in range(6)]
    cached = prompts[0]
    # Cache a prompt before the refit (the engine reports the hit the second time).
    first = await rollouts(rs, [cached])
    again = await rollouts(rs, [cached])
    assert again[0].usage["cached_prompt_tokens"] > 0 and first[0].token_ids == again[0].token_ids
    probe = prompt_of(64, 99)  # cached too; asked of the router alone after the refit
    await rollouts(rs, [probe])
    assert await asyncio.to_thread(router_hit_rate, rs, probe) > 0.5
    start = CommittedWeights("a", CheckpointSource(str(rs.stack.model_dir)))
    async with RefitClient([rs.admin], committed=start) as trainer:
        report = await trainer.refit(str(rs.weights_b), "2", mode="wait", clear_cache=True)
        assert report.ok and report.workers[0].version == "2" and report.workers[0].resumed
        # The router forgot this worker's blocks when the pause cleared the cache
        # (asked before any request could have refilled them).
        assert await asyncio.to_thread(router_hit_rate, rs, probe) == 0.0
        results = await rollouts(rs, prompts)
        # Nothing computed with A is reused: no prefix hit for the prompt cached
        # before, neither in the engine nor in the router's index.
        assert results[0].usage["cached_prompt_tokens"] == 0
        for prompt, result in zip(prompts, results, strict=True):
            reference = rs.fresh_b.Rollout(
                pb.RolloutRequest(
                    request_id=f"ref-{len(prompt)}",
                    prompt_token_ids=prompt,
                    greedy=True,
                    max_new_tokens=16,
                ),
                timeout=30,
            )
            same(result, reference)
            assert result.weight_versions == [("2", 0, len(result.token_ids))]
            assert result.weight_version == "2"
        assert (await trainer.versions()) == {rs.admin: "2"}
        assert await trainer._serving(rs.admin) == Served("2")  # whole, no update open
        # A refit that fails says why, and the worker goes back to the committed
        # weights and version, and serves again exactly as before.
        with pytest.raises(RefitError) as failed:
            await trainer.refit("/nonexistent/checkpoint", "3")
        (worker,) = failed.value.report.workers
        assert "does not exist" in str(failed.value) and worker.stage == "update"
        assert worker.outcome is Outcome.ROLLED_BACK and worker.resumed and worker.version == "2"
        assert not engine_load(rs).refit_state.paused
        assert (await trainer.versions()) == {rs.admin: "2"}
        again = await rollouts(rs, prompts[1:2])
        assert (again[0].token_ids, again[0].logprobs) == (
            results[1].token_ids,
            results[1].logprobs,
        )
        # Back to A for the other tests.
        await trainer.refit(str(rs.stack.model_dir), "a")


# -- pause modes with rollouts in flight through the stack --------------------------------


async def _in_flight(rs: RefitStack, n: int, max_tokens: int = 500) -> list[asyncio.Task[Any]]:
    """``n`` rollouts sent through the frontend, once all of them have reached the
    engine (a short one may have finished already); the last task closes the client."""
    client = driver.RolloutClient(
        rs.stack.base_url, MODEL, timeout_s=60, retry=driver.RetryPolicy(attempts=1)
    )

    async def one(i: int) -> Any:
        try:
            return await client.rollout(prompt_of(12, 500 + i), greedy=True, max_tokens=max_tokens)
        except driver.RolloutHTTPError as e:
            return e

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    deadline = time.monotonic() + 20
    while engine_load(rs).running_requests + sum(t.done() for t in tasks) < n:
        assert time.monotonic() < deadline, "rollouts did not all start"
        await asyncio.sleep(0.05)
    tasks.append(asyncio.ensure_future(_closing(client, list(tasks))))
    return tasks


async def _closing(client: driver.RolloutClient, tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()


async def test_pause_abort_ends_32_rollouts_within_a_second(refit_stack: RefitStack) -> None:
    rs = refit_stack
    tasks = await _in_flight(rs, 32)
    started = time.monotonic()
    ok(rs, "pause_generation", {"mode": "abort", "clear_cache": True})
    done, _ = await asyncio.wait(tasks[:-1], timeout=1.0)
    elapsed = time.monotonic() - started
    try:
        assert len(done) == 32, f"{len(done)} of 32 ended within {elapsed:.2f}s"
        outcomes = [t.result() for t in done]
        # The documented outcome: HTTP 503 (the frontend's word for a worker that
        # could not finish), which drivers retry; never a result that looks whole.
        assert all(isinstance(o, driver.RolloutHTTPError) for o in outcomes), outcomes[:3]
        # (Dynamo 1.3.0.post1's frontend folds the worker's failure into an HTTP 500.)
        status = 503 if frontend_maps_worker_errors() else 500
        assert all(o.status == status and o.retryable for o in outcomes), outcomes[0]
        wait_until(lambda: engine_load(rs).registered_requests == 0, 5, "engine idle")
    finally:
        ok(rs, "resume_generation")
        await tasks[-1]


async def test_pause_wait_returns_after_32_rollouts_finish(refit_stack: RefitStack) -> None:
    rs = refit_stack
    # The engine's label (the route answers null until a version was declared).
    version = engine_load(rs).refit_state.weight_version
    tasks = await _in_flight(rs, 32, max_tokens=100)
    answer = await asyncio.to_thread(ok, rs, "pause_generation", {"mode": "wait"})
    try:
        assert answer == {
            "status": "ok",
            "message": "Engine paused",
            "mode": "wait",
            "clear_cache": False,
        }
        # Returned once the engine finished them all (their answers are on the way).
        assert engine_load(rs).registered_requests == 0
        results = [await asyncio.wait_for(t, 10) for t in tasks[:-1]]
        assert all(isinstance(r, driver.RolloutResult) for r in results), results[:2]
        odd = [r for r in results if len(r.token_ids) != 100 or r.weight_version != version]
        assert not odd, [(len(r.token_ids), r.finish_reason, r.weight_versions) for r in odd]
        # Sent while paused: they wait, and run after resume, on the new version.
        late = asyncio.ensure_future(rollouts(rs, [prompt_of(12, 900 + i) for i in range(4)]))
        await asyncio.sleep(0.5)
        assert not late.done()
        ok(rs, "set_weight_version", {"weight_version": "after-wait"})
    finally:
        ok(rs, "resume_generation")
    for result in await asyncio.wait_for(late, 30):
        assert result.weight_versions == [("after-wait", 0, len(result.token_ids))]
    await tasks[-1]
    assert engine_load(rs).registered_requests == 0


async def test_pause_keep_freezes_32_rollouts_that_finish_after_resume(
    refit_stack: RefitStack,
) -> None:
    rs = refit_stack
    # The engine's label (the route answers null until a version was declared).
    before = engine_load(rs).refit_state.weight_version
    tasks = await _in_flight(rs, 32)
    ok(rs, "pause_generation", {"mode": "keep"})
    try:
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in tasks[:-1])
        assert engine_load(rs).running_requests == 32
        ok(rs, "set_weight_version", {"weight_version": "after-keep"})
    finally:
        ok(rs, "resume_generation")
    results = [await asyncio.wait_for(t, 30) for t in tasks[:-1]]
    assert all(isinstance(r, driver.RolloutResult) and len(r.token_ids) == 500 for r in results)
    for result in results:
        spans = result.weight_versions
        assert spans is not None and spans[0][0] == before and spans[-1][0] == "after-keep", spans
        assert spans[0][1] == 0 and spans[-1][2] == 500
    await tasks[-1]
    assert engine_load(rs).registered_requests == 0


# -- sleep, and the request-plane descriptor ------------------------------------------


def test_sleep_leaves_the_pool_and_wake_up_rejoins(refit_stack: RefitStack) -> None:
    rs = refit_stack
    stack = rs.stack
    assert ok(rs, "control/sleep", {"level": 1}) == {
        "status": "ok",
        "message": "Engine slept (level=1)",
    }
    try:
        assert ok(rs, "control/sleep")["message"] == "Engine already sleeping"
        wait_until(
            lambda: registered_workers(stack.kv_dir, stack.namespace) == 0, 10, "left the pool"
        )
    finally:
        assert ok(rs, "control/wake_up") == {"status": "ok", "message": "Engine woke"}
    wait_until(
        lambda: registered_workers(stack.kv_dir, stack.namespace) == 1, 10, "back in the pool"
    )
    assert ok(rs, "control/wake_up")["message"] == "Engine already awake"
    assert len(asyncio.run(rollouts(rs, [prompt_of(10, 3)]))[0].token_ids) == 16


def test_enable_rl_describes_the_routes_on_the_request_plane(refit_stack: RefitStack) -> None:
    rs = refit_stack
    script = textwrap.dedent(
        f"""
        import asyncio, json
        from dynamo.runtime import DistributedRuntime

        async def main():
            runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
            client = await runtime.endpoint("{rs.stack.namespace}.backend.rl").client()
            generate = await runtime.endpoint("{rs.stack.namespace}.backend.generate").client()
            await asyncio.wait_for(client.wait_for_instances(), 20)
            await asyncio.wait_for(generate.wait_for_instances(), 20)
            answers = [client.instance_ids(), generate.instance_ids()]
            for body in ({{"method": "routes"}}, {{"method": "pause"}}, {{}}):
                async for item in await client.round_robin(body):
                    answers.append(item.data())
            print(json.dumps(answers))
            runtime.shutdown()

        asyncio.run(main())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=rs.stack.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rl_ids, generate_ids, routes, unsupported, missing = json.loads(
        out.stdout.strip().splitlines()[-1]
    )
    # One instance id for both endpoints, as dynamo.vllm serves them from one runtime,
    # and so NeMo RL's readiness rule (ManagedDynamoRuntime._wait_for_frontend) holds.
    assert rl_ids == generate_ids and len(rl_ids) == 1
    assert ready_fleet(rs.stack.base_url, rs.stack.namespace, 1, MODEL) == [str(rl_ids[0])]
    assert routes["status"] == "ok" and routes["system_url"] == rs.admin
    # Dynamo 1.6's registry reports the weight world size; 1.3.0.post1's has none.
    from dynamo.common.rl.admin import RLRouteRegistry

    reports_world_size = "world_size" in inspect.signature(RLRouteRegistry).parameters
    assert routes.get("world_size") == (1 if reports_world_size else None)
    assert {"pause_generation", "update_weights_from_disk", "control/sleep"} <= set(
        routes["routes"]
    )
    assert unsupported["message"] == "rl request-plane endpoint only supports method='routes'"
    assert missing["message"] == "rl_dispatch: missing 'method' (str)"


async def test_paused_worker_holds_requests_until_resume_through_aiohttp(
    refit_stack: RefitStack,
) -> None:
    """A trainer's own HTTP session works too (aiohttp, as NeMo RL uses)."""
    rs = refit_stack
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{rs.admin}/engine/pause_generation", json={"mode": "abort"}) as r:
            assert (await r.json())["status"] == "ok"
        async with session.post(f"{rs.admin}/engine/resume_generation") as r:
            assert (await r.json()) == {"status": "ok", "message": "Engine resumed"}
