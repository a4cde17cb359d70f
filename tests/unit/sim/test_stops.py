"""Stop conditions: EOS, stop tokens, stop strings, min_tokens, lengths."""

from __future__ import annotations

from engine_server.backends.base import FinishReason, SamplingSpec
from tests.unit.sim.sim_helpers import collect, tokens_of

PROMPT = list(range(200, 230))


def greedy(**kw) -> SamplingSpec:
    return SamplingSpec(**{"max_tokens": 40, "temperature": 0.0, **kw})


async def reference_tokens(backend) -> list[int]:
    """The greedy output for PROMPT, with no stop condition but the length."""
    return tokens_of(await collect(backend, "ref", PROMPT, greedy()))


def assert_stopped(outs, tokens: list[int], stop: int | str) -> None:
    """The output is ``tokens``, finished by the stop token or string ``stop``."""
    assert tokens_of(outs) == tokens
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].stop_reason == stop


def match_end(backend, reference: list[int], text: str) -> int:
    """The index of the token of ``reference`` that completes the first match of ``text``."""
    return next(
        i for i in range(len(reference)) if text in backend.tokenizer.decode(reference[: i + 1])
    )


async def test_max_tokens_is_length(make_backend):
    backend, _ = await make_backend()
    outs = await collect(backend, "r", PROMPT, greedy(max_tokens=7))
    assert len(tokens_of(outs)) == 7
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.LENGTH
    assert final.stop_reason is None
    assert final.num_prompt_tokens == len(PROMPT)
    assert all(not o.finished for o in outs[:-1])


async def test_max_tokens_zero_finishes_at_once(make_backend):
    backend, _ = await make_backend()
    outs = await collect(backend, "r", PROMPT, greedy(max_tokens=0))
    assert len(outs) == 1
    assert outs[0].token_ids == [] and outs[0].finish_reason is FinishReason.LENGTH
    assert backend.load().running == 0


async def test_context_end_is_length(make_backend):
    backend, _ = await make_backend(context_length=64, num_kv_blocks=8, block_size=8)
    outs = await collect(backend, "r", list(range(60)), greedy(max_tokens=100))
    assert len(tokens_of(outs)) == 4
    assert outs[-1].finish_reason is FinishReason.LENGTH


async def test_stop_token_is_kept_and_reported(make_backend):
    backend, _ = await make_backend()
    reference = await reference_tokens(backend)
    stop = reference[7]
    first = reference.index(stop)
    outs = await collect(backend, "r", PROMPT, greedy(stop_token_ids=(stop,)))
    assert_stopped(outs, reference[: first + 1], stop)


async def test_min_tokens_masks_stop_tokens(make_backend):
    backend, _ = await make_backend()
    reference = await reference_tokens(backend)
    stop = reference[2]
    outs = await collect(backend, "r", PROMPT, greedy(stop_token_ids=(stop,), min_tokens=10))
    tokens = tokens_of(outs)
    assert stop not in tokens[:10]
    assert len(tokens) > 10
    if outs[-1].finish_reason is FinishReason.STOP:
        assert tokens[-1] == stop and tokens.index(stop) >= 10


async def test_eos_stops_unless_ignored(make_backend):
    backend, _ = await make_backend(eos_rate=0.2, eos_token_ids=(2, 5))
    outs = await collect(backend, "r", PROMPT, greedy(max_tokens=200))
    tokens = tokens_of(outs)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert tokens[-1] == 2 and outs[-1].stop_reason == 2
    assert 2 not in tokens[:-1]
    ignored = await collect(backend, "i", PROMPT, greedy(max_tokens=200, ignore_eos=True))
    assert len(tokens_of(ignored)) == 200
    assert ignored[-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(ignored)[: len(tokens)] == tokens


async def test_stop_string_on_detokenized_text(make_backend):
    backend, _ = await make_backend()
    reference = await reference_tokens(backend)
    word = backend.tokenizer.decode([reference[12]])
    # The tokens up to the one that completes the first match are kept.
    end = match_end(backend, reference, word)
    # A stop string spanning two tokens works too.
    pair = backend.tokenizer.decode(reference[5:7])[2:-1]
    pair_end = match_end(backend, reference, pair)
    for stop, expected_end in ((word, end), (pair, pair_end)):
        outs = await collect(backend, "r", PROMPT, greedy(stop_strings=("zzz-never", stop)))
        assert_stopped(outs, reference[: expected_end + 1], stop)


async def test_min_tokens_delays_stop_strings(make_backend):
    backend, _ = await make_backend()
    reference = await reference_tokens(backend)
    word = backend.tokenizer.decode([reference[3]])
    first = match_end(backend, reference, word)
    outs = await collect(backend, "r", PROMPT, greedy(stop_strings=(word,), min_tokens=first + 1))
    tokens = tokens_of(outs)
    assert len(tokens) > first + 1
    assert tokens == reference[: len(tokens)]
    if outs[-1].finish_reason is FinishReason.STOP:
        assert word in backend.tokenizer.decode(tokens[first + 1 :])
