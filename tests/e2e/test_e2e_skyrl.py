"""SkyRL's released client (``skyrl`` 0.4.0), unchanged, driving two vLLM workers
through Dynamo (issue 39 #4).

Two vLLM engine servers (CPU build, the template-less tiny model, ``--weight-
transfer-config '{"backend": "gloo"}'``), each behind a bridge with its system
port, and a Dynamo 1.6.1 frontend serving ``/inference/v1/generate``. SkyRL's
``RemoteInferenceClient`` gets the frontend as its ``proxy_url`` (the data
plane) and the two system URLs as its ``server_urls`` (the control plane it fans
out to); its rank 0's weight sync is vLLM's trainer engine for ``gloo`` with
SkyRL's ``SkyrlWeightSyncClient`` as the control plane, as SkyRL's
``build_trainer_engine`` builds it for NCCL. Each test drives one of SkyRL's
calls as its trainer makes it and asserts what SkyRL gets back: greedy rollouts
bit for bit what vLLM's ``AsyncLLM`` makes directly, before and after a weight
sync; a keep-mode pause that holds and then serves; the CPU build's refused
sleep as the error SkyRL raises; cache reset and world size as SkyRL reads them;
what a SkyRL user must set (a cache salt is refused; without ``tokenizer=``
SkyRL asks the frontend for ``/detokenize``, which it does not serve). vLLM's
own ``HTTPVLLMWeightSyncClient`` (its trainer's client for one server's
root-level routes) syncs the workers back afterwards.

SkyRL's modules come from ``.skyrl/`` (``make skyrl-deps``), imported by
``harness.skyrl`` on Python 3.11 (docs/testing.md says how and why); without it
the module is skipped. The module's tests share one stack and run in file order:
the weight syncs come last (the vLLM one puts the first checkpoint back).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bridge.dynamo_compat import serves_token_in_token_out
from harness import skyrl as skyrl_harness
from harness.checkpoints import tiny_weights_dir
from harness.engine import tiny_vllm_args
from harness.env import token_in_token_out_env
from harness.http import http_json
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from tests.e2e.e2e_stack import VLLM_STACK_MARKS
from tests.e2e.test_e2e_tito import Direct, bits, direct_engine

pytestmark = [
    *VLLM_STACK_MARKS,
    pytest.mark.skipif(
        not serves_token_in_token_out(), reason="this Dynamo has no /inference/v1/generate"
    ),
    pytest.mark.skipif(
        skyrl_harness.missing_reason() is not None, reason=str(skyrl_harness.missing_reason())
    ),
]

T = TypeVar("T")
MODEL = "tiny-skyrl"
WORKERS = 2
MAX_MODEL_LEN = 512
VLLM_ARGS = tiny_vllm_args(MAX_MODEL_LEN)
GLOO = '{"backend": "gloo"}'
# Shorter than a KV block: no prefix-cache hit can make two runs of one prompt differ.
PROMPTS = [[(seed * 131 + i * 37) % 900 + 3 for i in range(10)] for seed in range(2)]
# What SkyRL's trainer sends (engine_utils.get_vllm_sampling_params over its
# SamplingParams defaults), greedy as its eval sampling is.
TRAINER_PARAMS: dict[str, Any] = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "max_tokens": 16,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 1,
    "stop": None,
}


@dataclass
class Fleet:
    stack: Stack
    workers: list[str]  # each bridge's system URL: SkyRL's server_urls
    base: Direct  # vLLM's AsyncLLM on the checkpoint the workers start with
    other: Direct  # ... on the checkpoint the weight sync sends
    skyrl: skyrl_harness.Skyrl
    tokenizer: Any

    def client(self) -> Any:
        """SkyRL's client as a trainer builds it for an external router: the proxy
        for the data plane, every server for the control plane, a local tokenizer
        (Dynamo serves no ``/detokenize``)."""
        return self.skyrl.remote_inference_client.RemoteInferenceClient(
            proxy_url=self.stack.base_url,
            server_urls=self.workers,
            data_parallel_size=1,
            model_name=MODEL,
            tokenizer=self.tokenizer,
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The stack and, built while it starts, vLLM itself on both checkpoints."""
    skyrl = skyrl_harness.load()
    model_dir = tiny_model_dir("base")
    root = tmp_path_factory.mktemp("skyrl-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        workers = []
        for i in range(WORKERS):
            _, address = stack.start_engine(
                f"engine-{i}",
                *VLLM_ARGS,
                "--weight-transfer-config",
                GLOO,
                backend="vllm",
                timeout=300,
            )
            port = free_system_port()
            stack.start_bridge(f"bridge-{i}", address, DYN_SYSTEM_PORT=str(port))
            workers.append(f"http://127.0.0.1:{port}")
        stack.start_frontend(env=token_in_token_out_env())
        from transformers import AutoTokenizer

        base = direct_engine(model_dir, VLLM_ARGS)
        try:
            other = direct_engine(tiny_weights_dir(1, "base"), VLLM_ARGS)
            try:
                stack.wait_serving(workers=WORKERS, timeout=300)
                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                yield Fleet(stack, workers, base, other, skyrl, tokenizer)
            finally:
                other.close()
        finally:
            base.close()


def with_client(fleet: Fleet, call: Callable[[Any], Awaitable[T]]) -> T:
    """``call(client)`` on a loop of its own (SkyRL's client keeps one HTTP session
    per loop; ``AsyncLLM`` runs on its own loop in this thread between calls)."""

    async def run() -> T:
        async with fleet.client() as client:
            return await call(client)

    return asyncio.run(run())


def generate(fleet: Fleet, params: dict[str, Any], prompts: list[list[int]] = PROMPTS) -> Any:
    return with_client(
        fleet,
        lambda c: c.generate({"prompt_token_ids": prompts, "sampling_params": params}),
    )


def assert_as_vllm(
    out: Any, direct: Direct, params: dict[str, Any], prompts: list[list[int]]
) -> None:
    """SkyRL's output, prompt by prompt, is what ``AsyncLLM`` makes on that prompt:
    tokens, the sampled tokens' logprobs bit for bit, the finish reason."""
    for i, prompt in enumerate(prompts):
        done = direct.generate(prompt, **params).outputs[0]
        tokens = list(done.token_ids)
        assert out["response_ids"][i] == tokens
        assert out["stop_reasons"][i] == str(done.finish_reason)
        if params.get("logprobs") is None:
            assert out["response_logprobs"] is None
        else:
            want = [done.logprobs[j][t].logprob for j, t in enumerate(tokens)]
            assert bits(out["response_logprobs"][i]) == bits(want)


def test_every_file_of_the_wheel_compiles_on_this_python() -> None:
    """What ``--ignore-requires-python`` relies on."""
    assert skyrl_harness.syntax_errors_here() == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="no workaround below 3.12 to check")
def test_the_typed_dict_workaround_is_still_needed() -> None:
    """Without it, importing SkyRL's client fails in pydantic, asking for
    ``typing_extensions.TypedDict``; the day it does not, the workaround goes."""
    assert skyrl_harness.needs_typed_dict_workaround()


def test_greedy_rollouts_are_bit_exact_to_asyncllm(fleet: Fleet) -> None:
    """``generate`` posts each prompt to the frontend's ``/inference/v1/generate``
    (two prompts: the router spreads them over both workers); with a stop string
    taken from the first answer, SkyRL's multi-turn stop."""
    out = generate(fleet, TRAINER_PARAMS)
    assert_as_vllm(out, fleet.base, TRAINER_PARAMS, PROMPTS)
    assert all(len(ids) == TRAINER_PARAMS["max_tokens"] for ids in out["response_ids"])
    assert out["responses"][0] == fleet.tokenizer.decode(
        out["response_ids"][0], skip_special_tokens=True
    )
    text = out["responses"][0]
    stop = {**TRAINER_PARAMS, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]}
    assert_as_vllm(generate(fleet, stop, PROMPTS[:1]), fleet.base, stop, PROMPTS[:1])
    plain = {"temperature": 0.0, "max_tokens": 4}  # no logprobs asked: none returned
    assert_as_vllm(generate(fleet, plain), fleet.base, plain, PROMPTS)


def test_world_size_and_cache_reset_as_skyrl_reads_them(fleet: Fleet) -> None:
    async def calls(client: Any) -> tuple[Any, Any, Any]:
        return (
            await client.get_world_size(),
            await client.reset_prefix_cache(),
            await client.is_sleeping(),
        )

    world, reset, sleeping = with_client(fleet, calls)
    assert world == (WORKERS, 1)  # (total, per server): the gloo group's ranks
    assert reset == {url: {"status": 200, "body": {"success": True}} for url in fleet.workers}
    assert sleeping is False


def test_keep_mode_pause_holds_requests_until_resume(fleet: Fleet) -> None:
    """``pause(mode="keep")`` (SkyRL's ``pause_generation``) on every worker: a
    rollout sent meanwhile waits, registered, and finishes after ``resume`` with
    the tokens it would have had."""
    held_s = 1.5

    async def calls(client: Any) -> tuple[Any, Any, Any, bool]:
        paused = await client.pause(mode="keep")
        rollout = asyncio.create_task(
            client.generate({"prompt_token_ids": PROMPTS, "sampling_params": TRAINER_PARAMS})
        )
        await asyncio.sleep(held_s)
        held = not rollout.done()
        resumed = await client.resume()
        return paused, resumed, await asyncio.wait_for(rollout, 60), held

    paused, resumed, out, held = with_client(fleet, calls)
    assert paused == {url: {"status": 200, "body": {"status": "paused"}} for url in fleet.workers}
    assert resumed == {url: {"status": 200, "body": {"status": "resumed"}} for url in fleet.workers}
    assert held, f"a rollout finished within {held_s} s of a keep-mode pause"
    assert_as_vllm(out, fleet.base, TRAINER_PARAMS, PROMPTS)


def test_sleep_is_refused_on_the_cpu_build_and_the_workers_serve_on(fleet: Fleet) -> None:
    """vLLM's CPU build cannot sleep: the engine server refuses a sleep that would
    free nothing, and the bridge answers vLLM's 500. SkyRL raises it (aiohttp's
    ``ClientResponseError`` with the engine's reason); nothing slept, ``wake_up``
    is a no-op, and both workers serve as before. (vLLM's own server logs "sleep
    mode is not supported on CPU, ignore it", answers 200, and its
    ``is_sleeping`` then says true of an engine that never slept.)"""
    import aiohttp

    async def calls(client: Any) -> tuple[BaseException | None, bool, Any]:
        refused = None
        try:
            await client.sleep()  # SkyRL's default: level 2
        except aiohttp.ClientResponseError as e:
            refused = e
        return refused, await client.is_sleeping(), await client.wake_up()

    refused, sleeping, woke = with_client(fleet, calls)
    assert isinstance(refused, aiohttp.ClientResponseError), refused
    assert refused.status == 500 and "sleep" in refused.message, refused
    assert sleeping is False
    assert woke == {
        url: {"status": 200, "body": {"status": "awake", "tags": None}} for url in fleet.workers
    }
    assert_as_vllm(generate(fleet, TRAINER_PARAMS), fleet.base, TRAINER_PARAMS, PROMPTS)


def test_its_cache_salt_is_honoured(fleet: Fleet) -> None:
    """SkyRL's generator salts the prefix cache with its weight version
    (``generator.use_cache_salt``, on by default): the request's ``cache_salt``
    goes to each engine (contract revision 11), whose vLLM keeps the salted blocks
    apart, and changes no token or logprob (the salted prefix cache itself:
    tests/conformance/test_cache_salt.py, tests/e2e/test_e2e_tito.py)."""

    async def call(client: Any) -> Any:
        return await client.generate(
            {
                "prompt_token_ids": PROMPTS,
                "sampling_params": TRAINER_PARAMS,
                "cache_salt": "v0-policy",
            }
        )

    assert_as_vllm(with_client(fleet, call), fleet.base, TRAINER_PARAMS, PROMPTS)


def test_without_a_tokenizer_the_text_is_asked_of_the_frontend_which_has_no_route(
    fleet: Fleet,
) -> None:
    """Without ``tokenizer=`` SkyRL decodes each answer with ``POST /detokenize``
    on the proxy, a route of vLLM's server that Dynamo's frontend does not serve:
    the generation succeeds, then SkyRL raises the 404."""
    import aiohttp

    async def call() -> BaseException | None:
        client = fleet.client()
        client.tokenizer = None
        async with client:
            try:
                params = {"max_tokens": 2}
                await client.generate({"prompt_token_ids": PROMPTS[:1], "sampling_params": params})
            except aiohttp.ClientResponseError as e:
                return e
        return None

    refused = asyncio.run(call())
    assert isinstance(refused, aiohttp.ClientResponseError), refused
    assert refused.status == 404 and "/detokenize" in str(refused.request_info.url), refused


def send_gloo(weights: Path, client: Any, world_size: int, sync: Callable[[Any], None]) -> float:
    """vLLM's trainer engine for ``gloo`` on ``weights`` (rank 0 of ``world_size``),
    its init through ``client``, then ``sync(engine)``; its group shut down however
    it ends. Returns the seconds the init and the sync took."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what a trainer does: the engine server's plugin registers gloo
    from engine_server.weight_transfer_gloo import GlooTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=world_size,
        rank=0,
        packed=True,  # as SkyRL's build_trainer_engine asks of NCCL
    )
    started = time.monotonic()
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    try:
        sync(engine)
    finally:
        engine.shutdown()
    return time.monotonic() - started


def test_skyrl_weight_sync_over_gloo_serves_the_new_weights(fleet: Fleet) -> None:
    """SkyRL's non-colocated sync (``WorkerDispatch.save_weights_for_sampler``): the
    world size from the servers, the trainer engine initialised through
    ``SkyrlWeightSyncClient`` (``nccl_init_payloads``: rank offsets 1 and 2), then
    ``pause_generation`` (keep), ``send_weights`` (start, update with the
    broadcast, finish), the prefix-cache reset, ``resume_generation``. Both
    workers' greedy rollouts are then vLLM's on the other checkpoint."""
    before = generate(fleet, TRAINER_PARAMS)
    plane = fleet.skyrl.control_plane
    total, _ = with_client(fleet, lambda c: c.get_world_size())
    control = plane.SkyrlWeightSyncClient(
        fleet.workers, 1, init_payload_fn=plane.nccl_init_payloads
    )

    def one_sync(engine: Any) -> None:
        async def step(client: Any) -> None:
            await client.pause_generation()
            try:
                await asyncio.to_thread(engine.send_weights)
                await client.reset_prefix_cache(reset_running_requests=True)
            finally:
                await client.resume_generation()
            client.increment_weight_version()

        with_client(fleet, step)

    try:
        took = send_gloo(tiny_weights_dir(1, "base"), control, total + 1, one_sync)
    finally:
        control.close()
    after = generate(fleet, TRAINER_PARAMS)
    assert after["response_ids"] != before["response_ids"]  # the checkpoints differ
    assert_as_vllm(after, fleet.other, TRAINER_PARAMS, PROMPTS)
    # Each worker, not just the router's pick: the same prompt on both.
    both = generate(fleet, TRAINER_PARAMS, [PROMPTS[0]] * WORKERS)
    assert_as_vllm(both, fleet.other, TRAINER_PARAMS, [PROMPTS[0]] * WORKERS)
    print(f"SkyRL gloo sync to {WORKERS} workers: {took:.2f} s (init and one send)")


def test_vllms_own_http_weight_sync_client(fleet: Fleet) -> None:
    """vLLM's ``HTTPVLLMWeightSyncClient`` (one server's root-level routes, as
    vLLM's trainer engines call them: ``finish_weight_update`` without a version)
    puts the first checkpoint back, one worker at a time, each its own group of
    two, generation paused (keep) around it. Then both serve vLLM's rollouts on
    that checkpoint."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    model_dir = tiny_model_dir("base")
    with_client(fleet, lambda c: c.pause_generation())
    try:
        for url in fleet.workers:
            client = HTTPVLLMWeightSyncClient(url, timeout=120)
            send_gloo(model_dir, client, 2, lambda engine: engine.send_weights())
    finally:
        with_client(fleet, lambda c: c.resume_generation())
    assert_as_vllm(generate(fleet, TRAINER_PARAMS), fleet.base, TRAINER_PARAMS, PROMPTS)
    both = generate(fleet, TRAINER_PARAMS, [PROMPTS[1]] * WORKERS)
    assert_as_vllm(both, fleet.base, TRAINER_PARAMS, [PROMPTS[1]] * WORKERS)
    for url in fleet.workers:
        assert http_json(f"{url}/is_paused") == (200, {"is_paused": False})
