"""GRPO on one tiny policy: the task, the advantages, the loss, the on-policy check.

Pure functions over the trainer's model and the rollouts' tokens and
logprobs; no I/O. The task is verifiable and learnable in a few dozen steps by
the tiny Llama: the reward of a generation is the fraction of its tokens that
fall in a target id range (about 6% at random).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Task:
    """Which tokens are rewarded, and the shape of one step's batch."""

    target_low: int = 100
    target_high: int = 164  # exclusive
    prompt_length: int = 8
    prompts_per_step: int = 8
    group_size: int = 4  # samples per prompt (GRPO's group)
    max_tokens: int = 16

    def reward(self, tokens: Sequence[int]) -> float:
        if not tokens:
            return 0.0
        return sum(self.target_low <= t < self.target_high for t in tokens) / len(tokens)


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    """Each sample's reward against its group's (same prompt): (r - mean) / (std + eps)."""
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / max(1, len(group) - 1))
        out.extend((r - mean) / (std + 1e-4) for r in group)
    return out


def trainer_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], generations: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The trainer's logprob of every generated token (teacher forcing), with grad.

    One right-padded batch; sample i's values are ``out[i]`` (one per generated token).
    """
    sequences = [list(p) + list(g) for p, g in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for i, (prompt, gen) in enumerate(zip(prompts, generations, strict=True)):
        start = len(prompt)
        # Position t predicts token t + 1.
        rows = logprobs[i, start - 1 : start - 1 + len(gen)]
        out.append(rows.gather(-1, torch.tensor(list(gen)).unsqueeze(-1)).squeeze(-1))
    return out


def token_mult_prob_error(
    generation: Sequence[Sequence[float]], trainer: Sequence[torch.Tensor]
) -> float:
    """NeMo RL's on-policy check: mean over generated tokens of
    exp(|generation logprob - trainer logprob|) (1.0: the same policy)."""
    total, count = 0.0, 0
    for gen, train in zip(generation, trainer, strict=True):
        diff = (torch.tensor(list(gen), dtype=torch.float64) - train.detach().double()).abs()
        total += float(torch.exp(diff).sum())
        count += len(gen)
    return total / max(1, count)


def policy_loss(
    trainer: Sequence[torch.Tensor],
    generation: Sequence[Sequence[float]],
    advantages: Sequence[float],
    clip: float = 0.2,
) -> torch.Tensor:
    """PPO-clipped policy gradient, every generated token weighted alike."""
    terms = []
    for train, gen, advantage in zip(trainer, generation, advantages, strict=True):
        if not len(gen):
            continue
        ratio = torch.exp(train - torch.tensor(list(gen), dtype=train.dtype))
        clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
        terms.append(-torch.minimum(ratio * advantage, clipped * advantage))
    return torch.cat(terms).mean()
