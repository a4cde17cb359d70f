"""vLLM's token-in/token-out ``POST /inference/v1/generate`` through Dynamo's real
frontend, the bridge and a vLLM engine server (CPU build here), on the template-less
tiny model: greedy and seeded answers are bit for bit what vLLM's ``AsyncLLM`` makes
on the same prompt, sampled logprobs are the teacher-forced ones, what the contract
cannot honour is refused by name, and the capability sits on the worker's model
card. Routed experts go through the shared simulated stack (its engine reports them)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bridge.dynamo_compat import serves_token_in_token_out
from engine_contract.v1 import engine_pb2 as pb
from engine_server.vllm_processes import before_engine_start
from harness.engine import tiny_vllm_args
from harness.env import token_in_token_out_env
from harness.http import http_json
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = [
    pytest.mark.dynamo,
    pytest.mark.skipif(
        not serves_token_in_token_out(), reason="this Dynamo has no /inference/v1/generate"
    ),
]

MODEL = "tiny-tito"
CAPABILITY = "vllm_inference_v1_generate"
MAX_MODEL_LEN = 512
# Shorter than a KV block: no prefix-cache hit can make two runs of one prompt differ.
PROMPT = [(i * 37) % 300 + 3 for i in range(10)]
# A prompt's logprobs come from one prefill, a generation's from one decode step each:
# vLLM's CPU build gives the same bits either way; a GPU's kernels may round them in
# another order.
TEACHER_FORCED_TOLERANCE = 1e-4


@dataclass
class Direct:
    """vLLM's ``AsyncLLM`` in this process, set up as the engine server sets up its
    own (the same flags and the backend's defaults), on a loop of its own."""

    engine: Any
    loop: asyncio.AbstractEventLoop
    ids: Iterator[int] = field(default_factory=itertools.count)

    def generate(self, prompt: list[int], **params: Any) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        async def run() -> Any:
            final = None
            request_id = f"direct-{next(self.ids)}"
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt), SamplingParams(**params), request_id
            ):
                final = out
            assert final is not None and final.finished
            return final

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        """Shut the engine down, then end its tasks on this loop (its output handler
        holds a ZMQ socket that would keep the interpreter from exiting)."""
        self.engine.shutdown()
        self.engine = None  # its __del__ now, while the interpreter can still run it
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


def direct_engine(model_dir: Path, flags: list[str]) -> Direct:
    """The engine the vLLM backend builds from ``--model DIR *flags``, built here."""
    from engine_server.backends.vllm._env import apply_env_defaults

    apply_env_defaults()  # the CPU build's, as `--backend vllm` gets them
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_server.backends.vllm import args as cli

    parser = argparse.ArgumentParser()
    cli.add_cli_args(parser)
    namespace = parser.parse_args(["--model", str(model_dir), *flags])
    engine_args = cli.engine_args_from_namespace(namespace)
    cli.apply_engine_defaults(engine_args, cli.chosen_engine_args(namespace))
    before_engine_start()  # its sockets and EngineCore go with this process
    return Direct(AsyncLLM.from_engine_args(engine_args), asyncio.new_event_loop())


@pytest.fixture(scope="module")
def tito(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Direct]]:
    """The stack (its frontend serving the route) and, built while it starts, vLLM
    itself on the same model."""
    model_dir = tiny_model_dir("base")
    root = tmp_path_factory.mktemp("tito-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        flags = tiny_vllm_args(MAX_MODEL_LEN)
        _, address = stack.start_engine("engine", *flags, backend="vllm", timeout=300)
        stack.start_bridge("bridge", address)
        stack.start_frontend(env=token_in_token_out_env())
        direct = direct_engine(model_dir, flags)
        try:
            stack.wait_models([MODEL], timeout=300)
            yield stack, direct
        finally:
            direct.close()


def post(stack: Stack, params: dict[str, Any], prompt: list[int], **body: Any) -> tuple[int, Any]:
    return http_json(
        f"{stack.base_url}/inference/v1/generate",
        {"model": stack.model, "token_ids": prompt, "sampling_params": params, **body},
        timeout=120,
    )


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    content: list[dict[str, Any]]
    choice: dict[str, Any]


def answer(
    stack: Stack, params: dict[str, Any], prompt: list[int] = PROMPT, **envelope: Any
) -> Answer:
    status, body = post(stack, params, prompt, **envelope)
    assert status == 200, body
    (choice,) = body["choices"]
    tokens = choice["token_ids"]
    content = (choice["logprobs"] or {}).get("content") or []
    if params.get("logprobs") is not None:
        # vLLM's shape without a tokenizer: each token as "token_id:N".
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]
    logprobs = [c["logprob"] for c in content] if choice["logprobs"] is not None else None
    return Answer(tokens, logprobs, choice["finish_reason"], content, choice)


def native(direct: Direct, params: dict[str, Any], prompt: list[int] = PROMPT) -> Answer:
    final = direct.generate(prompt, **params)
    comp = final.outputs[0]
    tokens = list(comp.token_ids)
    logprobs = (
        [comp.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        if params.get("logprobs") is not None
        else None
    )
    return Answer(tokens, logprobs, str(comp.finish_reason), [], {})


def bits(values: list[float] | None) -> list[bytes]:
    return [struct.pack("<d", v) for v in values or []]


def assert_same(got: Answer, want: Answer) -> None:
    assert got.token_ids == want.token_ids
    assert bits(got.logprobs) == bits(want.logprobs)  # exact floats
    assert got.finish_reason == want.finish_reason


def needs_vllm(test: Any) -> Any:
    """The vLLM stack's marks (and skip where vLLM is not installed)."""
    for mark in VLLM_STACK_MARKS:
        test = mark(test)
    return test


def test_every_worker_card_says_it_serves_the_route(stack: Stack) -> None:
    """On the shared simulated stack: each bridge's model card, as the frontend reads it."""
    cards = [json.loads(p.read_text()) for p in (stack.kv_dir / "v1" / "mdc").iterdir()]
    ours = [c for c in cards if c["namespace"].startswith("ns-")]
    assert len(ours) >= 2, cards
    for card in ours:
        card_json = card["card_json"]
        if isinstance(card_json, str):
            card_json = json.loads(card_json)
        assert card_json["runtime_config"]["runtime_data"][CAPABILITY] is True


@needs_vllm
def test_greedy_is_bit_exact_to_asyncllm(tito: tuple[Stack, Direct]) -> None:
    stack, direct = tito
    plain = {"temperature": 0, "max_tokens": 24, "logprobs": 0}
    first = answer(stack, plain)
    assert_same(first, native(direct, plain))
    assert len(first.token_ids) >= 4 and first.logprobs is not None
    stop_at = first.token_ids[len(first.token_ids) // 2]
    cases = [
        # A stop token that occurs: the answer ends there, "stop".
        {**plain, "stop_token_ids": [stop_at]},
        # The budget filled whatever comes (min_tokens, ignore_eos), top_k moot at 0.
        {"temperature": 0, "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
         "top_k": 5, "logprobs": 0},
        # No logprobs asked for: none in the answer.
        {"temperature": 0, "max_tokens": 6},
    ]  # fmt: skip
    got = [answer(stack, params) for params in cases]
    for params, one in zip(cases, got, strict=True):
        assert_same(one, native(direct, params))
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop_at
    assert got[1].finish_reason == "length" and len(got[1].token_ids) == 12
    assert got[2].choice["logprobs"] is None


@needs_vllm
def test_seeded_sampling_is_bit_exact_to_asyncllm(tito: tuple[Stack, Direct]) -> None:
    """The same seed draws the same tokens in both engines: each logprob is vLLM's
    processed logprob (after temperature, top_k, top_p) of that very token."""
    stack, direct = tito
    params = {
        "temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 1234,
        "max_tokens": 16, "ignore_eos": True, "logprobs": 0,
    }  # fmt: skip
    got = answer(stack, params)
    assert_same(got, native(direct, params))
    assert len(got.token_ids) == 16 and got.finish_reason == "length"


@needs_vllm
def test_sampled_logprobs_equal_teacher_forced(tito: tuple[Stack, Direct]) -> None:
    """A temperature-1 sample's logprobs against the same tokens scored as a prompt
    (vLLM's prompt logprobs of prompt + answer); with top 2 alternatives each."""
    stack, direct = tito
    got = answer(stack, {"temperature": 1.0, "seed": 99, "max_tokens": 16, "ignore_eos": True,
                         "logprobs": 2})  # fmt: skip
    assert len(got.token_ids) == 16 and got.logprobs is not None
    forced = direct.generate(
        PROMPT + got.token_ids, temperature=0.0, max_tokens=1, prompt_logprobs=1
    ).prompt_logprobs
    teacher = [forced[len(PROMPT) + i][t].logprob for i, t in enumerate(got.token_ids)]
    from engine_server.backends.vllm._env import is_cpu_build

    if is_cpu_build():
        assert bits(got.logprobs) == bits(teacher)  # the CPU build: the very same floats
    else:
        worst = max(abs(a - b) for a, b in zip(got.logprobs, teacher, strict=True))
        assert worst <= TEACHER_FORCED_TOLERANCE, (got.logprobs, teacher)
    for entry in got.content:
        tops = entry["top_logprobs"]
        # The top 2, and the sampled token too when it is not among them (as vLLM).
        assert 2 <= len(tops) <= 3
        assert all(t["token"].startswith("token_id:") for t in tops)
        assert entry["logprob"] in [t["logprob"] for t in tops]


REFUSED = [
    ({"n": 2}, {}, "sampling_params.n"),
    ({"prompt_logprobs": 1}, {}, "sampling_params.prompt_logprobs"),
    ({"logprobs": -1}, {}, "sampling_params.logprobs"),
    ({"logit_bias": {"5": 2.0}}, {}, "sampling_params.logit_bias"),
    ({"bad_words": ["the"]}, {}, "sampling_params.bad_words"),
    (
        {"structured_outputs": {"json": {"type": "object"}}},
        {},
        "sampling_params.structured_outputs",
    ),
    ({"temprature": 0.5}, {}, "sampling_params.temprature"),
    ({"stop": "x", "detokenize": False}, {}, "sampling_params.detokenize"),
    ({}, {"cache_salt": "a\nb"}, "cache_salt"),
    ({}, {"priority": 3}, "priority"),
]


@needs_vllm
def test_what_cannot_be_honoured_is_a_400_naming_the_field(tito: tuple[Stack, Direct]) -> None:
    stack, _ = tito
    for params, envelope, name in REFUSED:
        status, body = post(stack, {"max_tokens": 4, **params}, PROMPT, **envelope)
        assert status == 400, (name, body)
        assert body["error"]["message"].startswith(name), (name, body)
    # And the worker serves on, unharmed.
    assert len(answer(stack, {"temperature": 0, "max_tokens": 3}).token_ids) == 3


def cached_chains(stack: Stack) -> dict[str, dict[tuple[int, ...], int]]:
    """The engine's prefix cache now, from its KV-event snapshot: per cache salt,
    each block's tokens and hash."""
    channel, stub = stack.engine_stub()
    with channel:
        size = stub.GetServerInfo(pb.GetServerInfoRequest()).engine_config.kv_block_size
        call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
        chains: dict[str, dict[tuple[int, ...], int]] = {}
        for message in call:
            for event in message.batch.events:
                if event.WhichOneof("event") == "stored":
                    stored = event.stored
                    for i, block_hash in enumerate(stored.block_hashes):
                        tokens = tuple(stored.token_ids[i * size : (i + 1) * size])
                        chains.setdefault(stored.cache_salt, {})[tokens] = block_hash
            if message.batch.snapshot.last:
                call.cancel()
                return chains
    raise AssertionError("the snapshot ended without its last part")


@needs_vllm
def test_a_cache_salt_keeps_its_blocks_apart_and_changes_nothing(
    tito: tuple[Stack, Direct],
) -> None:
    """SkyRL's ``cache_salt`` (and any client's): the same prompt under two salts is
    cached as two chains the engine names by their salts, and the answers are bit
    for bit vLLM's own without a salt."""
    stack, direct = tito
    prompt = [(i * 53) % 300 + 3 for i in range(200)]  # several KV blocks
    params = {"temperature": 0, "max_tokens": 6, "logprobs": 0}
    want = native(direct, params, prompt)
    assert_same(answer(stack, params, prompt, cache_salt="tenant-a"), want)
    assert_same(answer(stack, params, prompt, cache_salt="tenant-b"), want)
    chains = cached_chains(stack)
    a, b = chains.get("tenant-a", {}), chains.get("tenant-b", {})
    first = next(tokens for tokens in a if list(tokens) == prompt[: len(tokens)])
    assert first in b and a[first] != b[first]  # one prompt, two chains
    assert first not in chains.get("", {}) or chains[""][first] not in (a[first], b[first])


def test_routed_experts_come_back_from_their_start(stack: Stack) -> None:
    """The simulated engine reports routed experts (4 layers, top 2 of 8): the answer
    carries them as dynamo.vllm does, the rows from ``routed_experts_prompt_start``
    on, byte for byte what the engine server itself reports."""
    prompt = [11, 12, 13, 14, 15]
    got = answer(stack, {"temperature": 0, "max_tokens": 6, "ignore_eos": True,
                         "routed_experts_prompt_start": 2}, prompt)  # fmt: skip
    channel, stub = stack.engine_stub()
    with channel:
        own = list(
            stub.Generate(
                pb.GenerateRequest(
                    request_id="tito-direct",
                    prompt_token_ids=prompt,
                    sampling=pb.SamplingParams(temperature=0.0),
                    stop=pb.StopConditions(max_tokens=6, ignore_eos=True),
                ),
                timeout=30,
            )
        )
    experts = own[-1].finished.routed_experts
    assert got.token_ids == [t for r in own for t in r.token_ids]
    rows = len(prompt) + len(got.token_ids) - 1
    assert list(experts.shape) == [rows, 4, 2]
    row_bytes = len(experts.data) // rows
    routed = got.choice["routed_experts"]
    assert routed["start"] == 2 and routed["shape"] == [rows - 2, 4, 2]
    assert base64.b64decode(routed["data"]) == experts.data[2 * row_bytes :]
    assert (
        routed["dtype"] == pb.TensorDtype.Name(experts.dtype).removeprefix("TENSOR_DTYPE_").lower()
    )
