"""The simulated engine's settings and their command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from engine_server.backends.sim.routed_experts import RoutedExpertsConfig

DEFAULT_VOCAB_SIZE = 32000
DEFAULT_EOS_TOKEN_ID = 2


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes the sim; checked on construction.

    ``vocab_size`` and ``eos_token_ids`` left as None come from ``model`` when
    given, else from the built-in tokenizer's defaults (32000 and (2,)).
    """

    model: str | None = None
    served_model_name: str | None = None
    seed: int = 0
    context_length: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_tokens_per_s: float = 50000.0
    decode_step_ms: float = 5.0
    zero_delay: bool = False
    routed_experts: RoutedExpertsConfig | None = None
    startup_delay_s: float = 0.0
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    # Chance per position that EOS becomes the most likely token. With a large
    # vocabulary EOS is otherwise almost never drawn, so rollouts would all run
    # to their token budget; a rate gives realistic variable lengths.
    eos_rate: float = 0.0
    # Data-parallel ranks: engines side by side, each with its own scheduler and
    # prefix cache (num_kv_blocks each), as vLLM's data_parallel_size.
    dp_size: int = 1

    def __post_init__(self) -> None:
        def at_least(name: str, value: float, low: float) -> None:
            if value < low:
                raise ValueError(f"sim backend: {name} must be >= {low}, got {value}")

        at_least("context_length", self.context_length, 1)
        at_least("block_size", self.block_size, 1)
        at_least("num_kv_blocks", self.num_kv_blocks, 1)
        at_least("max_num_seqs", self.max_num_seqs, 1)
        at_least("dp_size", self.dp_size, 1)
        at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        at_least("decode_step_ms", self.decode_step_ms, 0)
        at_least("startup_delay_s", self.startup_delay_s, 0)
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(
                f"sim backend: prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}"
            )
        capacity = self.num_kv_blocks * self.block_size
        if self.context_length > capacity:
            raise ValueError(
                f"sim backend: context_length {self.context_length} does not fit in the KV "
                f"cache (num_kv_blocks {self.num_kv_blocks} x block_size {self.block_size} "
                f"= {capacity} tokens)"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # As vLLM: every running sequence must be able to decode in one step.
            raise ValueError(
                f"sim backend: max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs})"
            )
        if self.vocab_size is not None:
            at_least("vocab_size", self.vocab_size, 1)
        if not 0.0 <= self.eos_rate <= 1.0:
            raise ValueError(f"sim backend: eos_rate must be in [0, 1], got {self.eos_rate}")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
            if any(t < 0 for t in self.eos_token_ids):
                raise ValueError(f"sim backend: negative eos_token_ids {self.eos_token_ids}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add the sim's flags to ``parser``, in an argument group "sim backend"."""
        d = cls()
        g = parser.add_argument_group("sim backend")
        g.add_argument(
            "--model",
            default=None,
            metavar="DIR",
            help="HF-style model dir: vocab and EOS from config.json / generation_config.json, "
            "text from tokenizer.json (default: built-in made-up vocabulary)",
        )
        g.add_argument("--served-model-name", default=None, help="name the model is served under")
        g.add_argument("--seed", type=int, default=d.seed, help="engine seed (default %(default)s)")
        for flag, typ, default, text in (
            ("--context-length", int, d.context_length, "max prompt + generated tokens"),
            ("--block-size", int, d.block_size, "tokens per KV block"),
            ("--num-kv-blocks", int, d.num_kv_blocks, "KV cache capacity in blocks"),
            ("--max-num-seqs", int, d.max_num_seqs, "max running requests (rest wait)"),
            ("--max-num-batched-tokens", int, d.max_num_batched_tokens, "token budget per step"),
            ("--prefill-tokens-per-s", float, d.prefill_tokens_per_s, "prefill speed"),
            ("--decode-step-ms", float, d.decode_step_ms, "time of one decode step"),
            ("--startup-delay-s", float, d.startup_delay_s, "start() takes this long"),
            ("--eos-rate", float, d.eos_rate, "chance per position that EOS is most likely"),
            ("--dp-size", int, d.dp_size, "data-parallel ranks, each with its own KV cache"),
        ):
            # None when not given (the SimConfig default applies), so that a
            # generation config can tell the user's flags from defaults.
            g.add_argument(flag, type=typ, default=None, help=f"{text} (default {default})")
        g.add_argument(
            "--zero-delay",
            action="store_true",
            help="never sleep (only yield to the event loop): for overhead benchmarks",
        )
        g.add_argument(
            "--routed-experts",
            type=_routed_experts_arg,
            default=None,
            metavar="LAYERS,TOPK,NUM_EXPERTS",
            help="report synthetic routed experts (default: off)",
        )
        g.add_argument(
            "--vocab-size",
            type=int,
            default=None,
            help=f"built-in tokenizer's vocabulary size (default {DEFAULT_VOCAB_SIZE}; "
            "overrides --model's)",
        )
        g.add_argument(
            "--eos-token-id",
            type=_int_list_arg,
            default=None,
            metavar="ID[,ID...]",
            help=f"EOS token id(s) (default {DEFAULT_EOS_TOKEN_ID}; overrides --model's)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SimConfig:
        """Build the config from flags parsed with ``add_cli_args``."""
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {
            name: getattr(args, name) for name in names if getattr(args, name, None) is not None
        }
        if getattr(args, "eos_token_id", None) is not None:
            values["eos_token_ids"] = args.eos_token_id
        return cls(**values)


def _routed_experts_arg(text: str) -> RoutedExpertsConfig:
    try:
        return RoutedExpertsConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
