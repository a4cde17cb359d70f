"""Tokens and logprobs: deterministic, greedy vs sampled, masks, penalties."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys

from engine_server.backends.base import SamplingSpec
from engine_server.backends.sim.hashing import mix64
from engine_server.backends.sim.sampler import REST_LOGIT, Sampler
from tests.unit.sim.sim_helpers import collect, logprobs_of, tokens_of

PROMPT = list(range(100, 140))
GREEDY = SamplingSpec(max_tokens=40, temperature=0.0, top_k=1, logprobs=0)
SAMPLED = SamplingSpec(max_tokens=40, temperature=1.0, logprobs=0)

_CHILD = """
import asyncio, json, sys
from engine_server.backends.base import SamplingSpec
from engine_server.backends.sim import SimBackend

async def main():
    b = SimBackend(zero_delay=True, seed=7)
    await b.start(None)
    out = {}
    for name, spec in (("greedy", SamplingSpec(max_tokens=40, temperature=0.0, top_k=1,
                                               logprobs=0)),
                       ("sampled", SamplingSpec(max_tokens=40, temperature=1.0, logprobs=0))):
        toks, lps = [], []
        async for o in b.generate("req-" + name, list(range(100, 140)), spec):
            toks += o.token_ids
            lps += o.logprobs
        out[name] = [toks, lps]
    await b.shutdown()
    print(json.dumps(out))

asyncio.run(main())
"""


async def test_same_inputs_same_outputs_across_instances_and_processes(make_backend):
    a, _ = await make_backend(seed=7)
    b, _ = await make_backend(seed=7)
    here = {}
    for name, spec in (("greedy", GREEDY), ("sampled", SAMPLED)):
        first = await collect(a, "req-" + name, PROMPT, spec)
        second = await collect(b, "req-" + name, PROMPT, spec)
        assert tokens_of(first) == tokens_of(second)
        assert logprobs_of(first) == logprobs_of(second)
        here[name] = [tokens_of(first), logprobs_of(first)]
    # Another interpreter with another str-hash salt gives bit-identical results.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, env=env, stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await child.communicate()
    assert child.returncode == 0
    assert json.loads(stdout) == here


async def test_seed_changes_the_model(make_backend):
    a, _ = await make_backend(seed=1)
    b, _ = await make_backend(seed=2)
    assert tokens_of(await collect(a, "r", PROMPT, GREEDY)) != tokens_of(
        await collect(b, "r", PROMPT, GREEDY)
    )


async def test_greedy_and_sampled_differ(make_backend):
    backend, _ = await make_backend()
    greedy = await collect(backend, "g", PROMPT, GREEDY)
    sampled = await collect(backend, "s", PROMPT, SAMPLED)
    assert tokens_of(greedy) != tokens_of(sampled)
    # Greedy picks the argmax: temperature 0 and top_k 1 are the same thing.
    also_greedy = await collect(
        backend, "g2", PROMPT, SamplingSpec(max_tokens=40, temperature=0.0, logprobs=0)
    )
    assert tokens_of(also_greedy) == tokens_of(greedy)
    # Greedy never reports a higher logprob than the argmax can have: all < 0.
    assert all(lp < 0 for lp in logprobs_of(greedy))


async def test_seeded_sampling_is_reproducible(make_backend):
    backend, _ = await make_backend()
    spec = SamplingSpec(max_tokens=40, temperature=1.0, seed=1234, logprobs=0)
    first = await collect(backend, "a", PROMPT, spec)
    # Same seed under another request id: same draws.
    second = await collect(backend, "b", PROMPT, spec)
    assert tokens_of(first) == tokens_of(second)
    other = await collect(
        backend, "c", PROMPT, SamplingSpec(max_tokens=40, temperature=1.0, seed=99, logprobs=0)
    )
    assert tokens_of(other) != tokens_of(first)
    # Unseeded requests draw by request id: different ids, different tokens.
    x = await collect(backend, "x", PROMPT, SAMPLED)
    y = await collect(backend, "y", PROMPT, SAMPLED)
    assert tokens_of(x) != tokens_of(y)


def _full_logprobs(sampler: Sampler, h: int) -> dict[int, float]:
    """Log-softmax over the whole (tiny) vocabulary, computed the long way."""
    ids, logits = sampler.candidates(h)
    all_logits = {t: REST_LOGIT for t in range(sampler.vocab_size)}
    all_logits.update(zip(ids, logits, strict=True))
    log_z = math.log(sum(math.exp(v) for v in all_logits.values()))
    return {t: v - log_z for t, v in all_logits.items()}


def test_greedy_logprobs_are_the_full_vocab_log_softmax():
    sampler = Sampler(vocab_size=50, seed=3, eos_token_ids=(), eos_rate=0.0)
    rs = sampler.prepare(SamplingSpec(max_tokens=1, temperature=0.0, logprobs=50), "r")
    for h in range(20):
        expected = _full_logprobs(sampler, mix64(h))
        token, lp, top = sampler.choose(mix64(h), 10, rs)
        assert token == max(expected, key=expected.__getitem__)
        assert math.isclose(lp, expected[token], abs_tol=1e-12)
        assert top is not None and len(top) == 50
        assert top[0][0] == token
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert {t for t, _ in top} == set(range(50))
        for t, v in top:
            assert math.isclose(v, expected[t], abs_tol=1e-12)


def test_sampled_logprobs_are_processed_and_masks_apply():
    sampler = Sampler(vocab_size=50, seed=3, eos_token_ids=(), eos_rate=0.0)
    top2 = sampler.prepare(SamplingSpec(max_tokens=1, top_k=2, logprobs=3), "r")
    top_p = sampler.prepare(SamplingSpec(max_tokens=1, top_p=0.5, logprobs=50), "r")
    hot = sampler.prepare(SamplingSpec(max_tokens=1, temperature=2.0, logprobs=50), "r")
    drawn = set()
    for h in range(40):
        full = _full_logprobs(sampler, mix64(h))
        ranked = sorted(full, key=full.__getitem__, reverse=True)
        token, lp, top = sampler.choose(mix64(h), h, top2)
        assert token in ranked[:2]
        drawn.add(token == ranked[0])
        # Processed: renormalised over the two tokens left by top_k.
        p0, p1 = math.exp(full[ranked[0]]), math.exp(full[ranked[1]])
        assert math.isclose(math.exp(lp), math.exp(full[token]) / (p0 + p1), rel_tol=1e-9)
        assert top is not None and [t for t, _ in top] == ranked[:3]
        assert top[2][1] == float("-inf")

        token, lp, top = sampler.choose(mix64(h), h, top_p)
        assert top is not None
        kept = [(t, v) for t, v in top if v > float("-inf")]
        assert math.isclose(sum(math.exp(v) for _, v in kept), 1.0, rel_tol=1e-9)
        assert token in {t for t, _ in kept}
        # top_p keeps the smallest prefix whose mass reaches p.
        mass_before_last = sum(math.exp(full[t]) for t in ranked[: len(kept) - 1])
        assert mass_before_last < 0.5 <= mass_before_last + math.exp(full[ranked[len(kept) - 1]])

        token, lp, top = sampler.choose(mix64(h), h, hot)
        assert top is not None
        assert math.isclose(sum(math.exp(v) for _, v in top), 1.0, rel_tol=1e-9)
    assert drawn == {True, False}, "top_k=2 sampling should draw both tokens sometimes"


def test_banned_tokens_are_never_drawn():
    sampler = Sampler(vocab_size=12, seed=0, eos_token_ids=(), eos_rate=0.0)
    rs = sampler.prepare(SamplingSpec(max_tokens=1, temperature=5.0, logprobs=0), "r")
    banned = frozenset({0, 1, 2, 3, 4, 5})
    for h in range(200):
        token, _, _ = sampler.choose(mix64(h), h, rs, banned=banned)
        assert token not in banned


async def test_penalties_change_the_output(make_backend):
    backend, _ = await make_backend(vocab_size=20)
    plain = await collect(backend, "a", [3, 4, 5], SamplingSpec(max_tokens=60, temperature=0.0))
    spec = SamplingSpec(max_tokens=60, temperature=0.0, frequency_penalty=2.0)
    penalised = await collect(backend, "b", [3, 4, 5], spec)

    def top_count(tokens: list[int]) -> int:
        return max(tokens.count(t) for t in set(tokens))

    assert tokens_of(plain) != tokens_of(penalised)
    assert top_count(tokens_of(penalised)) < top_count(tokens_of(plain))


async def test_top_logprobs_in_outputs(make_backend):
    backend, _ = await make_backend()
    spec = SamplingSpec(max_tokens=10, temperature=1.0, logprobs=4)
    outs = await collect(backend, "r", PROMPT, spec)
    tops = [top for o in outs for top in (o.top_logprobs or [])]
    assert len(tops) == len(tokens_of(outs)) == len(logprobs_of(outs)) == 10
    for top in tops:
        values = [v for _, v in top]
        assert len(top) == 4 and values == sorted(values, reverse=True)
    no_lp = await collect(backend, "n", PROMPT, SamplingSpec(max_tokens=5))
    assert all(o.logprobs is None and o.top_logprobs is None for o in no_lp)
