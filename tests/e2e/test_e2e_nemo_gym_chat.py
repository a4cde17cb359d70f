"""NeMo RL's chat path for NeMo-Gym, replayed through the real frontend and bridge.

NeMo RL's token wrapper (``nemo_rl/models/generation/dynamo/token_wrapper.py``)
forwards NeMo-Gym's chat request to Dynamo's ``/v1/chat/completions`` with the
prompt it rendered itself in ``nvext.token_data`` and ``"engine_data"`` added to
``nvext.extra_fields``; NeMo-Gym then trains on
``nvext.engine_data.{prompt_token_ids, completion_token_ids, completion_logprobs}``
(never on the choice's text or logprobs). Dynamo 1.6.1's frontend takes
``token_data`` as the prompt and passes the final chunk's ``engine_data`` through;
the bundle itself is the worker's to write, as dynamo.vllm does, and the bridge
writes it. The model is a base checkpoint without a chat template, served for
chat with ``--custom-jinja-template`` as NeMo RL's ``worker_args`` pass it.
Each test runs on the simulated engine and on vLLM (CPU build here).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import tiny_vllm_args
from harness.http import http_json
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import CHAT_TEMPLATE, tiny_model_dir
from rl_client import wire
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = pytest.mark.dynamo
transformers = pytest.importorskip("transformers")

MODEL = "gym-base"
EOS = 1
# EOS the likeliest token at 20% of the sim's positions: some greedy answers end on it.
SIM_ARGS = ("--eos-rate", "0.2", "--decode-step-ms", "1")
DIRECT_IDS = itertools.count()


@dataclass
class GymStack:
    base_url: str
    address: str
    backend: str
    tokenizer: Any


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=VLLM_STACK_MARKS)])
def gym(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GymStack]:
    backend: str = request.param
    model_dir = tiny_model_dir("base")
    root = tmp_path_factory.mktemp(f"gym-chat-{backend}")
    template = root / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    args, timeout = (SIM_ARGS, 60.0) if backend == "sim" else (tiny_vllm_args(), 300.0)
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL, f"gym{backend}")
        _, address = stack.start_engine("engine", *args, backend=backend, timeout=timeout)
        # As NeMo RL's worker_args pass them for chat on a template-less model.
        stack.start_bridge(
            "bridge",
            address,
            "--custom-jinja-template",
            str(template),
            "--endpoint-types",
            "chat,completions",
        )
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=timeout)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        yield GymStack(stack.base_url, address, backend, tokenizer)


def render(gym: GymStack, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    """The prompt as NeMo RL's wrapper renders it (the tokenizer's own template call)."""
    ids = gym.tokenizer.apply_chat_template(
        messages,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    return [int(t) for t in ids]


def gym_body(
    messages: list[dict[str, str]], token_data: list[int], *, temperature: float, max_tokens: int
) -> dict[str, Any]:
    """NeMo RL's body as it reaches the frontend: NeMo-Gym's chat request with its
    token capture on (``logprobs``, ``top_logprobs: 0``, ``return_tokens_as_token_ids``),
    then the wrapper's ``nvext`` (``extra_fields`` + ``engine_data``, ``token_data``)."""
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "nvext": {"extra_fields": ["engine_data"], "token_data": token_data},
    }


def chat(gym: GymStack, body: dict[str, Any]) -> tuple[dict[str, Any], wire.TokenBundle]:
    status, answer = http_json(f"{gym.base_url}/v1/chat/completions", body, timeout=120)
    assert status == 200, answer
    return answer, wire.read_token_bundle(answer["nvext"]["engine_data"])


def direct(gym: GymStack, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The same greedy completion asked of the engine server itself."""
    request = pb.GenerateRequest(
        request_id=f"gym-direct-{next(DIRECT_IDS)}",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0, top_p=1.0),
        stop=pb.StopConditions(max_tokens=max_tokens, stop_token_ids=[EOS]),
        output=pb.OutputOptions(logprobs=0),
    )
    tokens: list[int] = []
    logprobs: list[float] = []
    with grpc.insecure_channel(gym.address) as channel:
        for delta in pb_grpc.EngineServiceStub(channel).Generate(request, timeout=120):
            tokens += delta.token_ids
            logprobs += delta.logprobs
    return tokens, logprobs


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


USER = [{"role": "user", "content": "Hello there, how are you?"}]


def test_the_bundle_is_the_prompt_sent_and_every_token_with_its_logprob(gym: GymStack) -> None:
    """NeMo RL's sampled request (temperature 1): the bundle is what NeMo-Gym
    accepts, and the choice (tokens as ``token_id:N``) agrees with it token for token."""
    prompt = render(gym, USER, generation_prompt=True)
    answer, bundle = chat(gym, gym_body(USER, prompt, temperature=1.0, max_tokens=16))
    assert bundle.prompt_token_ids == prompt
    assert 1 <= len(bundle.completion_token_ids) <= 16
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == len(bundle.completion_token_ids)
    assert bundle.finished is True
    shown = answer["choices"][0]["logprobs"]["content"]
    assert [int(e["token"].removeprefix("token_id:")) for e in shown] == (
        bundle.completion_token_ids[: len(shown)]
    )
    assert [e["logprob"] for e in shown] == pytest.approx(
        bundle.completion_logprobs[: len(shown)], rel=1e-6
    )


def test_greedy_bundle_equals_the_engine_server_bit_for_bit(gym: GymStack) -> None:
    prompt = render(gym, USER, generation_prompt=True)
    _, bundle = chat(gym, gym_body(USER, prompt, temperature=0.0, max_tokens=12))
    tokens, logprobs = direct(gym, prompt, 12)
    assert bundle.completion_token_ids == tokens and tokens
    assert bits(bundle.completion_logprobs) == bits(logprobs)


def test_second_turn_runs_the_spliced_prompt_not_a_retokenization(gym: GymStack) -> None:
    """Turn 2 as NeMo RL builds it: turn 1's exact prompt and tokens, then the
    template's tokens after the assistant message (its prefix splice). The engine
    must run those ids, not the frontend's rendering of the messages."""
    first = render(gym, USER, generation_prompt=True)
    answer, turn1 = chat(gym, gym_body(USER, first, temperature=0.0, max_tokens=12))
    messages = [
        *USER,
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""},
        {"role": "user", "content": "And then?"},
    ]
    history = render(gym, messages[:2], generation_prompt=False)
    rendered = render(gym, messages, generation_prompt=True)
    prior = turn1.prompt_token_ids + turn1.completion_token_ids
    kept = prior[:-1] if prior[-1] == EOS else prior
    cut = [i for i, t in enumerate(rendered) if t == EOS][history.count(EOS) - 1]
    spliced = [*kept, EOS, *rendered[cut + 1 :]]
    # Otherwise the check below could not tell the two apart.
    assert spliced != rendered, "the retokenized history happens to equal the engine's tokens"
    answer2, turn2 = chat(gym, gym_body(messages, spliced, temperature=0.0, max_tokens=8))
    assert turn2.prompt_token_ids == spliced
    assert answer2["usage"]["prompt_tokens"] == len(spliced)
    tokens, logprobs = direct(gym, spliced, 8)
    assert turn2.completion_token_ids == tokens
    assert bits(turn2.completion_logprobs) == bits(logprobs)


def test_the_bundle_keeps_logprobs_the_choice_does_not_show(gym: GymStack) -> None:
    """A client that asks for engine_data but not logprobs still gets aligned
    logprobs in the bundle; the OpenAI choice shows none, as asked."""
    prompt = render(gym, USER, generation_prompt=True)
    body = gym_body(USER, prompt, temperature=0.0, max_tokens=6)
    for key in ("logprobs", "top_logprobs", "return_tokens_as_token_ids"):
        del body[key]
    answer, bundle = chat(gym, body)
    assert answer["choices"][0].get("logprobs") is None
    tokens, logprobs = direct(gym, prompt, 6)
    assert bundle.completion_token_ids == tokens
    assert bits(bundle.completion_logprobs) == bits(logprobs)


def test_no_bundle_unless_asked(gym: GymStack) -> None:
    prompt = render(gym, USER, generation_prompt=True)
    body = gym_body(USER, prompt, temperature=0.0, max_tokens=4)
    body["nvext"] = {"token_data": prompt}
    status, answer = http_json(f"{gym.base_url}/v1/chat/completions", body, timeout=120)
    assert status == 200, answer
    assert wire.COMPLETION_TOKEN_IDS not in (answer.get("nvext") or {}).get("engine_data", {})


def test_an_answer_ending_on_eos_keeps_it_in_the_bundle(gym: GymStack) -> None:
    """The frontend hides EOS from the text; the bundle keeps it, with its logprob,
    as the engine made it (what the trainer must see)."""
    if gym.backend != "sim":
        pytest.skip("the random tiny Llama on vLLM almost never picks EOS")
    for n in range(40):
        messages = [{"role": "user", "content": f"Question number {n}?"}]
        prompt = render(gym, messages, generation_prompt=True)
        answer, bundle = chat(gym, gym_body(messages, prompt, temperature=0.0, max_tokens=24))
        if answer["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no greedy sim answer ended on EOS in 40 prompts")
    assert bundle.completion_token_ids[-1] == EOS
    tokens, logprobs = direct(gym, prompt, 24)
    assert bundle.completion_token_ids == tokens
    assert bits(bundle.completion_logprobs) == bits(logprobs)
