"""vLLM's own engine arguments on the engine server's command line.

Every ``AsyncEngineArgs`` flag is accepted as vLLM spells it (``--model``,
``--max-model-len``, ``--kv-cache-memory-bytes`` ...), in an argument group of
the server's parser. How: vLLM's parser is built with
``AsyncEngineArgs.add_cli_args`` and each of its actions is copied into that
group, with two changes so that the two sets of flags can never collide:

- every destination gets a ``vllm_`` prefix (``args.vllm_model``), so a core
  flag with the same destination (``--log-level``) keeps its own value;
- no flag has a default on the namespace (``argparse.SUPPRESS``): only what the
  user gave is there, so "the user chose it" is exact, and everything else is
  ``AsyncEngineArgs``'s own default, as for an engine built in code (NeMo RL's
  ``AsyncEngineArgs(**kwargs)``);
- an option string the server already uses, or reserves (``core_flags()``), is
  renamed ``--vllm-<name>``: today only ``--log-level`` (vLLM's shortcut for
  its logging config) becomes ``--vllm-log-level``. Short options that
  collide are dropped.

vLLM's ``FlexibleArgumentParser`` extras are not available on the server's
parser: write JSON-valued flags whole (``--compilation-config '{"mode": 0}'``,
not ``--compilation-config.mode 0``), names with dashes, and no ``--config``
YAML file.

Defaults applied where the user gave none (``apply_engine_defaults``):
prefix caching on; ``logprobs_mode=processed_logprobs`` (the logprobs of the
distribution tokens are drawn from, after temperature, top-k and top-p: what
NeMo RL's vLLM worker and ``dynamo.vllm --enable-rl`` use, and what a GRPO
trainer's importance ratios need); on the CPU build a 1 GiB KV cache when
neither ``--kv-cache-memory-bytes`` nor ``VLLM_CPU_KVCACHE_SPACE`` is given
(the CPU build refuses to start without one), and no torch.compile while
TorchDynamo is off (see below). KV events are set up by the backend at start
(see ``kv_events.py``).

Compilation on the CPU build: ``TORCHDYNAMO_DISABLE=1`` (``_env.py``) turns
torch.compile into a no-op, but vLLM 0.32's default compilation mode still
ahead-of-time compiles the model through Dynamo and fails at start ("aot_compile
is not supported by the current configuration"). So while Dynamo is off and the
user chose no compilation (no ``--compilation-config`` mode, no
``--optimization-level``, no ``--enforce-eager``), the mode becomes NONE: the
model runs eagerly, as it would with Dynamo off anyway. A user who does choose
a compilation mode gets Dynamo back (``compile_env_conflicts``), unless they
disabled it themselves. CUDA builds are never touched.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from engine_server.backends.vllm._env import env_defaults_applied, is_cpu_build

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

DEST_PREFIX = "vllm_"
RENAME_PREFIX = "--vllm-"


def core_flags() -> frozenset[str]:
    """Every option string of the server core's own parser (the one without a
    backend): treated as taken whatever the order of registration."""
    from engine_server.cli import build_parser

    return frozenset(build_parser(None)._option_string_actions)


CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def _vllm_parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add vLLM's engine flags to ``parser`` in their own group; return the group."""
    group = parser.add_argument_group(
        "vLLM engine",
        "vLLM's AsyncEngineArgs, spelled as by `vllm serve` (see the module docs "
        "of engine_server.backends.vllm.args for the differences).",
    )
    taken = set(parser._option_string_actions) | core_flags()
    for action in _vllm_parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        new = copy.copy(action)
        new.dest = DEST_PREFIX + action.dest
        new.default = argparse.SUPPRESS
        if new.metavar is None and new.choices is None and new.nargs != 0:
            new.metavar = action.dest.upper()  # what vLLM's help shows, not VLLM_<DEST>
        strings = []
        for opt in action.option_strings:
            if opt not in taken:
                strings.append(opt)
            elif opt.startswith("--") and RENAME_PREFIX + opt[2:] not in taken:
                strings.append(RENAME_PREFIX + opt[2:])
        if not strings:
            continue
        new.option_strings = strings
        taken.update(strings)
        group._add_action(new)
    return group


def chosen_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user gave, by ``AsyncEngineArgs`` field name."""
    prefix = len(DEST_PREFIX)
    return {
        name[prefix:]: value for name, value in vars(args).items() if name.startswith(DEST_PREFIX)
    }


def engine_args_from_namespace(args: argparse.Namespace) -> AsyncEngineArgs:
    """The ``AsyncEngineArgs`` the user asked for (vLLM's defaults elsewhere)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    chosen = chosen_engine_args(args)
    unknown = sorted(set(chosen) - fields)
    if unknown:
        raise ValueError(f"not engine arguments of vLLM {_vllm_version()}: {unknown}")
    return AsyncEngineArgs(**chosen)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


# vllm_cfg keys of a NeMo RL generation section -> AsyncEngineArgs fields.
_GENERATION_ENGINE_FIELDS = {
    "max_model_len": "max_model_len",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    "kv_cache_dtype": "kv_cache_dtype",
    "enable_return_routed_experts": "enable_return_routed_experts",
    "load_format": "load_format",
    "logprobs_mode": "logprobs_mode",
    "skip_tokenizer_init": "skip_tokenizer_init",
    "enable_prefix_caching": "enable_prefix_caching",
}


def generation_engine_args(engine: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A NeMo RL section's engine settings as ``AsyncEngineArgs`` fields, as NeMo
    RL's vLLM worker passes them (``precision`` is the dtype, or fp8 weights;
    an expert-parallel size above 1 turns vLLM's expert parallelism on)."""
    out: dict[str, Any] = {}
    for key, value in engine.items():
        if key in _GENERATION_ENGINE_FIELDS:
            out[_GENERATION_ENGINE_FIELDS[key]] = value
        elif key == "precision":
            if value == "fp8":
                out["quantization"] = "fp8"
            else:
                out["dtype"] = value
        elif key == "expert_parallel_size":
            out["enable_expert_parallel"] = value > 1
    out.update(kwargs)
    return out


def needs_dynamo(engine_args: AsyncEngineArgs) -> bool | None:
    """Whether the user's compilation choice needs TorchDynamo; None: they chose none.

    Mirrors how vLLM resolves it: ``--enforce-eager`` means mode NONE, an
    explicit ``--compilation-config`` mode wins, else the optimization level
    decides (O0 means NONE), and an untouched level (O2) is no choice at all.
    """
    from vllm.config.compilation import CompilationMode
    from vllm.config.vllm import OptimizationLevel

    if engine_args.enforce_eager:
        return False
    mode = engine_args.compilation_config.mode
    if mode is not None:
        return mode != CompilationMode.NONE
    level = int(engine_args.optimization_level)  # the flag's value arrives as text
    if level != OptimizationLevel.O2:
        return level > OptimizationLevel.O0
    return None


def apply_engine_defaults(
    engine_args: AsyncEngineArgs, chosen: Collection[str] | None = None
) -> dict[str, Any]:
    """Fill in the backend's defaults where the user gave none; return what changed.

    ``chosen``: the fields the user set (from the command line); None when the
    engine arguments were built in code, where a value equal to vLLM's
    default counts as not chosen.
    """
    changed: dict[str, Any] = {}
    if engine_args.enable_prefix_caching is None:
        changed["enable_prefix_caching"] = True
    if (
        "logprobs_mode" not in chosen
        if chosen is not None
        else engine_args.logprobs_mode == "raw_logprobs"
    ):
        changed["logprobs_mode"] = "processed_logprobs"
    cpu = is_cpu_build()
    if (
        cpu
        and engine_args.kv_cache_memory_bytes is None
        and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    ):
        changed["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_CACHE_BYTES
    for key, value in changed.items():
        setattr(engine_args, key, value)
    if cpu:
        changed.update(_reconcile_compilation(engine_args))
    return changed


def _reconcile_compilation(engine_args: AsyncEngineArgs) -> dict[str, Any]:
    """TorchDynamo off and a compilation mode that needs it never meet (CPU build)."""
    from vllm.config import CompilationMode

    wanted = needs_dynamo(engine_args)
    disabled = os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    if wanted is None and disabled:
        engine_args.compilation_config.mode = CompilationMode.NONE
        return {"compilation_config.mode": "NONE"}
    if wanted and disabled:
        if "TORCHDYNAMO_DISABLE" not in env_defaults_applied():
            raise ValueError(
                "the chosen compilation mode needs torch.compile, but TORCHDYNAMO_DISABLE=1 "
                "is set in the environment: unset it, or pass --enforce-eager"
            )
        # Our own default, not the user's: the engine process (spawned later,
        # with this environment) gets TorchDynamo back.
        os.environ.pop("TORCHDYNAMO_DISABLE")
        return {"env TORCHDYNAMO_DISABLE": "unset (a compilation mode was chosen)"}
    return {}
