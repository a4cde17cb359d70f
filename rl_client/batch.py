"""A batch of rollouts as NeMo RL's generation output (``GenerationOutputSpec``).

The driver side of "the driver assembles the same output generate would
return": many rollouts sent concurrently (bounded) through ``RolloutClient``,
then laid out exactly as NeMo RL's vLLM worker lays out a batch
(``VllmGenerationWorker.generate``):

- ``output_ids`` ``[B, W]``: each prompt, then its generated tokens, right-padded
  with ``pad_token_id``; ``W`` = the padded prompt width + the longest
  generation. The prompts' dtype (int64 for lists).
- ``logprobs`` ``[B, W]`` float32: 0 over the prompt and the padding, the
  sampled tokens' logprobs after it.
- ``generation_lengths``, ``unpadded_sequence_lengths`` ``[B]`` int64,
  ``truncated`` ``[B]`` bool (finish reason "length").
- With routed experts (MoE, "R3"): ``routed_experts`` ``[B, W, layers, top_k]``
  in the narrowest signed dtype holding the expert ids and -1 (int8 up to 128
  experts, int16 up to 32768, else int32; int16 when the expert count is not
  given), aligned as NeMo RL's ``pad_and_align_routed_expert_indices``: the
  engine's routes first, -1 for routes missing before the sequence's last
  token, NeMo RL's default route (0..top_k-1) past it; and the counts
  ``r3_routed_experts_{missing,expected,actual}_routes`` ``[B]`` int64.

numpy only, as everything in the bridge package (which never imports torch):
a trainer wanting tensors converts them without a copy,
``{k: torch.from_numpy(v) for k, v in out.to_dict().items()}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rl_client.driver import RolloutResult

if TYPE_CHECKING:
    from rl_client.driver import RolloutClient

# NeMo RL's fallback when the expert count is unknown, and its missing-route mark.
FALLBACK_ROUTED_EXPERTS_DTYPE = np.int16
MISSING_ROUTE = -1


def routed_experts_dtype(num_experts: int | None) -> np.dtype[Any]:
    """The narrowest signed integer dtype for expert ids 0..num_experts-1 and -1."""
    if num_experts is None:
        return np.dtype(FALLBACK_ROUTED_EXPERTS_DTYPE)
    for dtype in (np.int8, np.int16):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


@dataclass
class GenerationOutput:
    """NeMo RL's GenerationOutputSpec for one batch, as numpy arrays, plus the
    per-rollout results it was built from (in the batch's order)."""

    output_ids: np.ndarray
    logprobs: np.ndarray
    generation_lengths: np.ndarray
    unpadded_sequence_lengths: np.ndarray
    truncated: np.ndarray
    results: list[RolloutResult]
    routed_experts: np.ndarray | None = None
    r3_routed_experts_missing_routes: np.ndarray | None = None
    r3_routed_experts_expected_routes: np.ndarray | None = None
    r3_routed_experts_actual_routes: np.ndarray | None = None

    def to_dict(self) -> dict[str, np.ndarray]:
        """The arrays under NeMo RL's keys."""
        out: dict[str, Any] = {
            "output_ids": self.output_ids,
            "logprobs": self.logprobs,
            "generation_lengths": self.generation_lengths,
            "unpadded_sequence_lengths": self.unpadded_sequence_lengths,
            "truncated": self.truncated,
        }
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
            out["r3_routed_experts_missing_routes"] = self.r3_routed_experts_missing_routes
            out["r3_routed_experts_expected_routes"] = self.r3_routed_experts_expected_routes
            out["r3_routed_experts_actual_routes"] = self.r3_routed_experts_actual_routes
        return out


def prompts_from_padded(
    input_ids: Any, input_lengths: Sequence[int] | Any
) -> tuple[list[list[int]], int, np.dtype[Any]]:
    """Right-padded ``[B, L]`` ids and their lengths (numpy or torch) -> the prompts,
    the padded width and the ids' dtype."""
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    lengths = np.asarray(input_lengths.cpu() if hasattr(input_lengths, "cpu") else input_lengths)
    if ids.ndim != 2 or lengths.shape != (ids.shape[0],):
        raise ValueError(
            f"input_ids must be [batch, length] and input_lengths [batch]; got "
            f"{ids.shape} and {lengths.shape}"
        )
    if (lengths < 1).any() or (lengths > ids.shape[1]).any():
        raise ValueError(f"input_lengths must be in [1, {ids.shape[1]}], got {lengths.tolist()}")
    prompts = [ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]
    return prompts, int(ids.shape[1]), ids.dtype


def assemble(
    prompts: Sequence[Sequence[int]],
    results: Sequence[RolloutResult],
    *,
    pad_token_id: int,
    padded_input_length: int | None = None,
    ids_dtype: np.dtype[Any] | type = np.int64,
    num_routed_experts: int | None = None,
) -> GenerationOutput:
    """Lay out finished rollouts as NeMo RL's batch output (see the module docs)."""
    if len(prompts) != len(results):
        raise ValueError(f"{len(prompts)} prompts for {len(results)} results")
    batch = len(prompts)
    prompt_width = max((len(p) for p in prompts), default=0)
    if padded_input_length is None:
        padded_input_length = prompt_width
    elif padded_input_length < prompt_width:
        raise ValueError(f"padded_input_length {padded_input_length} < longest prompt")
    width = padded_input_length + max((len(r.token_ids) for r in results), default=0)

    output_ids = np.full((batch, width), pad_token_id, dtype=ids_dtype)
    logprobs = np.zeros((batch, width), dtype=np.float32)
    generation_lengths = np.zeros(batch, dtype=np.int64)
    unpadded = np.zeros(batch, dtype=np.int64)
    truncated = np.zeros(batch, dtype=np.bool_)
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        n_in, n_gen = len(prompt), len(result.token_ids)
        output_ids[i, :n_in] = prompt
        output_ids[i, n_in : n_in + n_gen] = result.token_ids
        logprobs[i, n_in : n_in + n_gen] = result.logprobs
        generation_lengths[i] = n_gen
        unpadded[i] = n_in + n_gen
        truncated[i] = result.finish_reason == "length" and n_gen > 0
    out = GenerationOutput(
        output_ids, logprobs, generation_lengths, unpadded, truncated, list(results)
    )
    if any(r.routed_experts is not None for r in results):
        _routed_experts(out, width, routed_experts_dtype(num_routed_experts))
    return out


def _routed_experts(out: GenerationOutput, width: int, dtype: np.dtype[Any]) -> None:
    """NeMo RL's pad_and_align_routed_expert_indices for every row of the batch."""
    shapes = {r.routed_experts.shape[1:] for r in out.results if r.routed_experts is not None}
    if len(shapes) != 1:
        raise ValueError(f"rollouts disagree on the routed experts' [layers, top_k]: {shapes}")
    ((layers, top_k),) = shapes
    batch = len(out.results)
    # NeMo RL's default route (0..top_k-1) everywhere first, then each row's own.
    full = np.broadcast_to(np.arange(top_k, dtype=dtype), (batch, width, layers, top_k)).copy()
    missing = np.zeros(batch, dtype=np.int64)
    expected = np.zeros(batch, dtype=np.int64)
    actual = np.zeros(batch, dtype=np.int64)
    for i, result in enumerate(out.results):
        routes = (
            result.routed_experts.to_numpy().astype(dtype)
            if result.routed_experts is not None
            else np.zeros((0, layers, top_k), dtype=dtype)
        )
        valid = int(out.unpadded_sequence_lengths[i])
        expected[i] = min(max(valid - 1, 0), width)
        actual[i] = routes.shape[0]
        copied = min(int(expected[i]), routes.shape[0])
        full[i, :copied] = routes[:copied]
        missing[i] = max(int(expected[i]) - routes.shape[0], 0)
        full[i, copied : int(expected[i])] = MISSING_ROUTE
    out.routed_experts = full
    out.r3_routed_experts_missing_routes = missing
    out.r3_routed_experts_expected_routes = expected
    out.r3_routed_experts_actual_routes = actual


async def generate_batch(
    client: RolloutClient,
    prompts: Sequence[Sequence[int]] | Any,
    input_lengths: Sequence[int] | Any | None = None,
    *,
    pad_token_id: int,
    greedy: bool = False,
    stop_strings: Sequence[Sequence[str] | None] | None = None,
    max_new_tokens: int | None = None,
    concurrency: int = 64,
    num_routed_experts: int | None = None,
    weight_version: str | None = None,
) -> GenerationOutput:
    """Send every prompt as a rollout (at most ``concurrency`` at once) and lay the
    results out as NeMo RL's batch output.

    ``prompts``: lists of token ids, or NeMo RL's right-padded ``input_ids``
    ``[B, L]`` with ``input_lengths`` (numpy or torch). ``stop_strings``: one
    list (or None) per sample, merged by the engine with its configured ones.
    Each rollout is retried as ``client.retry`` says; if one still fails, the
    others are cancelled and the error is raised, naming the sample.
    ``weight_version``: every rollout's tokens come from this weight version
    (``RolloutClient.rollout``); a rollout a weight change ended has finish reason
    "weight_version_changed" and its tokens so far (``truncated`` false).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if input_lengths is not None:
        prompt_lists, padded, dtype = prompts_from_padded(prompts, input_lengths)
    else:
        prompt_lists = [list(p) for p in prompts]
        if any(not p for p in prompt_lists):
            raise ValueError("every prompt needs at least one token")
        padded, dtype = max((len(p) for p in prompt_lists), default=0), np.dtype(np.int64)
    if stop_strings is not None and len(stop_strings) != len(prompt_lists):
        raise ValueError(f"{len(stop_strings)} stop-string lists for {len(prompt_lists)} prompts")
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> RolloutResult:
        async with gate:
            try:
                return await client.rollout(
                    prompt_lists[i],
                    greedy=greedy,
                    stop_strings=(stop_strings[i] or ()) if stop_strings is not None else (),
                    max_tokens=max_new_tokens,
                    weight_version=weight_version,
                )
            except Exception as e:
                e.add_note(f"(sample {i} of the batch)")
                raise

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(len(prompt_lists))]
    except ExceptionGroup as failed:  # the first failure; the others were cancelled
        raise failed.exceptions[0] from None
    return assemble(
        prompt_lists,
        [t.result() for t in tasks],
        pad_token_id=pad_token_id,
        padded_input_length=padded,
        ids_dtype=dtype,
        num_routed_experts=num_routed_experts,
    )
