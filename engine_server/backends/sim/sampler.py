"""Deterministic "model" logits and vLLM-style sampling over them.

The model: at every position the context's rolling hash picks a few candidate
tokens with pseudo-random logits in [0, LOGIT_SPREAD); every other token of the
vocabulary has the same low logit, REST_LOGIT. That keeps the full-vocabulary
softmax in closed form (the rest is one group of equal tokens), so logprobs are
exact and a step costs O(candidates), not O(vocab).

Sampling follows vLLM's order: penalties, temperature, min_p, top_k, top_p, then
a draw from an RNG keyed by (engine seed, request seed or request id,
position). Reported logprobs are those of the distribution the token was drawn
from (vLLM's ``logprobs_mode="processed_logprobs"``); greedy requests get the
log-softmax of the (penalised) logits, which without penalties is the raw
logprob. Penalties act on the candidate tokens only: the rest keep REST_LOGIT,
which is already far below any candidate, so the closed form survives.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine_server.backends.base import SamplingSpec
from engine_server.backends.sim.hashing import MASK64, mix64, str_key, unit_float

NUM_CANDIDATES = 8
LOGIT_SPREAD = 8.0
REST_LOGIT = -8.0
# vLLM treats temperatures below this as greedy.
GREEDY_EPS = 1e-5
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407
_EOS_SALT = 0x454F53
_LOGIT_SCALE = LOGIT_SPREAD / (1 << 21)
_NEG_INF = float("-inf")

# One sampled token: id, its logprob (None unless asked) and the top
# alternatives (None unless asked for k > 0).
TokenChoice = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass(frozen=True)
class RequestSampling:
    """A request's sampling parameters, normalised once at admission."""

    greedy: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    draw_key: int
    logprobs: int | None
    has_penalties: bool


class _Pool(NamedTuple):
    """What a token is picked from, bans and penalties applied: the candidates
    ``ids`` with their ``logits``, and ``n_rest`` more tokens at REST_LOGIT (the
    lowest ids not in ``excluded``)."""

    ids: list[int]
    logits: list[float]
    n_rest: int
    excluded: list[int]


def _nth_rest(j: int, excluded_sorted: Sequence[int]) -> int:
    """The j-th smallest token id (0-based) that is not in ``excluded_sorted``."""
    x = j
    for e in excluded_sorted:
        if e <= x:
            x += 1
        else:
            break
    return x


class Sampler:
    """The simulated model's next-token distribution and the sampler over it."""

    def __init__(self, vocab_size: int, seed: int, eos_token_ids: Sequence[int], eos_rate: float):
        self.vocab_size = vocab_size
        self._engine_seed = seed & MASK64
        self._seed_key = mix64(self._engine_seed ^ 0x53494D)
        self._num_candidates = min(NUM_CANDIDATES, vocab_size)
        self._eos = eos_token_ids[0] if eos_token_ids else None
        self._eos_threshold = int(eos_rate * (1 << 53))

    def set_weights(self, key: int) -> None:
        """New weights: every logit changes (key 0 is the weights the sim started with)."""
        self._seed_key = mix64(self._engine_seed ^ 0x53494D ^ (key & MASK64))

    def prepare(self, spec: SamplingSpec, request_id: str) -> RequestSampling:
        """Normalise a spec: greedy detection, top_k off as 0, the draw key."""
        source = (spec.seed & MASK64) ^ 0x5EED if spec.seed is not None else str_key(request_id)
        top_k = spec.top_k if spec.top_k > 0 else 0
        return RequestSampling(
            greedy=spec.temperature < GREEDY_EPS or top_k == 1,
            temperature=spec.temperature,
            top_k=top_k if top_k < self.vocab_size else 0,
            top_p=spec.top_p,
            min_p=spec.min_p,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            repetition_penalty=spec.repetition_penalty,
            draw_key=mix64(self._seed_key ^ mix64(source)),
            logprobs=spec.logprobs,
            has_penalties=bool(
                spec.presence_penalty or spec.frequency_penalty or spec.repetition_penalty != 1.0
            ),
        )

    def candidates(self, ctx_hash: int) -> tuple[list[int], list[float]]:
        """The context's candidate tokens and their logits (the model's "forward")."""
        x = mix64(ctx_hash ^ self._seed_key)
        vocab, k = self.vocab_size, self._num_candidates
        ids: list[int] = []
        logits: list[float] = []
        if vocab <= k:
            ids = list(range(vocab))
            for _ in ids:
                x = (x * _LCG_MUL + _LCG_INC) & MASK64
                logits.append((x >> 43) * _LOGIT_SCALE)
        else:
            # An LCG from one mixed seed: cheap, and plenty random for 8 draws.
            # High bits pick the token, middle bits its logit.
            while len(ids) < k:
                x = (x * _LCG_MUL + _LCG_INC) & MASK64
                tok = ((x >> 32) * vocab) >> 32
                if tok not in ids:
                    ids.append(tok)
                    logits.append(((x >> 11) & 0x1FFFFF) * _LOGIT_SCALE)
        eos = self._eos
        if eos is not None and self._eos_threshold and eos < vocab:
            if (mix64(x ^ _EOS_SALT) >> 11) < self._eos_threshold:
                if eos in ids:
                    logits[ids.index(eos)] = LOGIT_SPREAD
                else:
                    ids[-1], logits[-1] = eos, LOGIT_SPREAD
        elif eos is not None and eos in ids:
            # EOS rate 0: EOS drawn as a candidate is never the likeliest token.
            logits[ids.index(eos)] = 0.0
        return ids, logits

    def choose(
        self,
        ctx_hash: int,
        position: int,
        rs: RequestSampling,
        output_counts: Mapping[int, int] | None = None,
        context_tokens: Collection[int] | None = None,
        banned: Collection[int] = (),
    ) -> TokenChoice:
        """Pick the token at ``position`` after the context hashed to ``ctx_hash``.

        ``output_counts`` (generated token counts) and ``context_tokens`` (prompt
        and generated ids) feed the penalties; ``banned`` ids get probability 0
        (stop tokens before min_tokens, as vLLM's min-tokens processor does).
        """
        ids, logits = self.candidates(ctx_hash)
        n_rest = self.vocab_size - len(ids)
        excluded = ids
        if banned:
            extra = [t for t in set(banned) if 0 <= t < self.vocab_size and t not in ids]
            kept = [i for i, t in enumerate(ids) if t not in banned]
            if kept or n_rest - len(extra) > 0:  # never ban every token
                excluded = ids + extra
                n_rest -= len(extra)
                ids = [ids[i] for i in kept]
                logits = [logits[i] for i in kept]
        if rs.has_penalties:
            logits = self._penalize(ids, logits, rs, output_counts or {}, context_tokens or ())
        pool = _Pool(ids, logits, n_rest, excluded)
        if rs.greedy:
            return self._greedy(pool, rs)
        return self._sample(pool, rs, position)

    @staticmethod
    def _penalize(
        ids: list[int],
        logits: list[float],
        rs: RequestSampling,
        counts: Mapping[int, int],
        context: Collection[int],
    ) -> list[float]:
        out = []
        rep, freq, pres = rs.repetition_penalty, rs.frequency_penalty, rs.presence_penalty
        for t, logit in zip(ids, logits, strict=True):
            if rep != 1.0 and t in context:
                logit = logit / rep if logit > 0 else logit * rep
            n = counts.get(t, 0)
            if n:
                logit -= freq * n + pres
            out.append(logit)
        return out

    def _greedy(self, pool: _Pool, rs: RequestSampling) -> TokenChoice:
        ids, logits, n_rest, excluded = pool
        best = max(range(len(ids)), key=logits.__getitem__) if ids else -1
        if best < 0 or (n_rest > 0 and REST_LOGIT > logits[best]):
            token, logit = _nth_rest(0, sorted(excluded)), REST_LOGIT
        else:
            token, logit = ids[best], logits[best]
        if rs.logprobs is None:
            return token, None, None
        top = max([*logits, REST_LOGIT]) if n_rest else max(logits)
        z = sum(math.exp(v - top) for v in logits) + n_rest * math.exp(REST_LOGIT - top)
        log_z = top + math.log(z)
        alternatives = None
        if rs.logprobs > 0:
            ranked = self._ranked(pool, REST_LOGIT, rs.logprobs)
            alternatives = [(t, v - log_z) for t, v in ranked]
        return token, logit - log_z, alternatives

    @staticmethod
    def _ranked(pool: _Pool, rest: float, k: int) -> list[tuple[int, float]]:
        """The k most likely (token, logit), most likely first (the rest at ``rest``)."""
        ids, logits, n_rest, excluded = pool
        order = sorted(range(len(ids)), key=lambda i: -logits[i])
        above = [(ids[i], logits[i]) for i in order if logits[i] >= rest]
        below = [(ids[i], logits[i]) for i in order if logits[i] < rest]
        room = max(0, min(n_rest, k - len(above)))
        ex = sorted(excluded)
        return (above + [(_nth_rest(j, ex), rest) for j in range(room)] + below)[:k]

    def _sample(self, pool: _Pool, rs: RequestSampling, position: int) -> TokenChoice:
        ids, logits, n_rest, excluded = pool
        inv_t = 1.0 / rs.temperature
        scaled = [v * inv_t for v in logits]
        rest = REST_LOGIT * inv_t
        # Groups in descending logit order: [logit, candidate index or -1 for
        # the rest, size, kept]. Masks only ever cut a suffix of this order.
        groups: list[list] = []
        rest_placed = n_rest == 0
        for i in sorted(range(len(ids)), key=lambda i: -scaled[i]):
            if not rest_placed and scaled[i] < rest:
                groups.append([rest, -1, n_rest, n_rest])
                rest_placed = True
            groups.append([scaled[i], i, 1, 1])
        if not rest_placed:
            groups.append([rest, -1, n_rest, n_rest])
        top = groups[0][0]
        n_kept = len(groups)  # groups[:n_kept] survive, the last possibly in part
        if rs.min_p > 0.0:
            threshold = top + math.log(rs.min_p)
            n_kept = max(1, sum(1 for g in groups if g[0] >= threshold))
        if rs.top_k:
            left = rs.top_k
            for gi in range(n_kept):
                g = groups[gi]
                if g[3] >= left:
                    g[3] = left
                    n_kept = gi + 1
                    break
                left -= g[3]
        if rs.top_p < 1.0:
            z = sum(g[3] * math.exp(g[0] - top) for g in groups[:n_kept])
            before = 0.0
            for gi in range(n_kept):
                g = groups[gi]
                w = math.exp(g[0] - top)
                if before + g[3] * w >= rs.top_p * z:
                    # A token stays while the mass ranked above it is below top_p.
                    g[3] = max(1, min(g[3], math.ceil((rs.top_p * z - before) / w)))
                    n_kept = gi + 1
                    break
                before += g[3] * w
        kept = groups[:n_kept]
        z_kept = sum(g[3] * math.exp(g[0] - top) for g in kept)
        log_z = top + math.log(z_kept)
        ex = sorted(excluded)

        target = unit_float(mix64(rs.draw_key ^ mix64(position))) * z_kept
        token, logit = -1, rest
        cum = 0.0
        for g in kept:
            w = math.exp(g[0] - top)
            mass = g[3] * w
            if target < cum + mass or g is kept[-1]:
                if g[1] >= 0:
                    token, logit = ids[g[1]], g[0]
                else:
                    j = min(g[3] - 1, max(0, int((target - cum) / w)))
                    token, logit = _nth_rest(j, ex), g[0]
                break
            cum += mass
        if rs.logprobs is None:
            return token, None, None
        alternatives = None
        if rs.logprobs > 0:
            alternatives = self._alternatives(ids, groups, n_kept, ex, log_z, rs.logprobs)
        return token, logit - log_z, alternatives

    @staticmethod
    def _alternatives(
        ids: list[int],
        groups: list[list],
        n_kept: int,
        excluded_sorted: list[int],
        log_z: float,
        k: int,
    ) -> list[tuple[int, float]]:
        """Top k of the processed distribution; masked tokens come last, at -inf."""
        out: list[tuple[int, float]] = []
        masked: list[tuple[int, float]] = []
        for gi, g in enumerate(groups):
            kept = g[3] if gi < n_kept else 0
            if g[1] >= 0:
                (out if kept else masked).append((ids[g[1]], g[0] - log_z if kept else _NEG_INF))
                continue
            for j in range(min(kept, k)):
                out.append((_nth_rest(j, excluded_sorted), g[0] - log_z))
            for j in range(kept, min(g[2], kept + k)):
                masked.append((_nth_rest(j, excluded_sorted), _NEG_INF))
            if len(out) >= k:
                break
        return (out + masked)[:k]
