"""vLLM's own engine arguments on the engine server's command line.

Every ``AsyncEngineArgs`` flag is accepted as vLLM spells it (``--model``,
``--max-model-len``, ``--kv-cache-memory-bytes`` ...), in an argument group of
the server's parser. How: vLLM's parser is built with
``AsyncEngineArgs.add_cli_args`` and each of its actions is copied into that
group, with two changes so that the two sets of flags can never collide:

- every destination gets a ``vllm_`` prefix (``args.vllm_model``), so a core
  flag with the same destination (``--log-level``) keeps its own value;
- an option string the server already uses, or reserves (``CORE_FLAGS``), is
  renamed ``--vllm-<name>``: today only ``--log-level`` (vLLM's shortcut for
  its logging config) becomes ``--vllm-log-level``. Short options that
  collide are dropped.

vLLM's ``FlexibleArgumentParser`` extras are not available on the server's
parser: write JSON-valued flags whole (``--compilation-config '{"mode": 0}'``,
not ``--compilation-config.mode 0``), names with dashes, and no ``--config``
YAML file.

Defaults applied where the user gave none (``apply_engine_defaults``):
prefix caching on; on the CPU build a 1 GiB KV cache when neither
``--kv-cache-memory-bytes`` nor ``VLLM_CPU_KVCACHE_SPACE`` is given (the CPU
build refuses to start without one). KV events are set up by the backend at
start (see ``kv_events.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from engine_server.backends.vllm._env import is_cpu_build

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

DEST_PREFIX = "vllm_"
RENAME_PREFIX = "--vllm-"
# The server core's flags: treated as taken even if the core adds them after
# the backend's, so the result does not depend on the order of registration.
CORE_FLAGS = frozenset(
    "--listen --allow-remote --tls-cert --tls-key --tls-client-ca --grace-period-s "
    "--max-message-bytes --max-stop-strings --kv-replay-batches --temperature --top-p "
    "--top-k --max-new-tokens --stop-token-ids --log-level --backend -h --help".split()
)
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
    taken = set(parser._option_string_actions) | CORE_FLAGS
    for action in _vllm_parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        new = copy.copy(action)
        new.dest = DEST_PREFIX + action.dest
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


def engine_args_from_namespace(args: argparse.Namespace) -> AsyncEngineArgs:
    """The ``AsyncEngineArgs`` the user asked for (vLLM's defaults elsewhere)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    values: dict[str, Any] = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        name = DEST_PREFIX + field.name
        if hasattr(args, name):
            values[field.name] = getattr(args, name)
    return AsyncEngineArgs(**values)


def apply_engine_defaults(engine_args: AsyncEngineArgs) -> dict[str, Any]:
    """Fill in the backend's defaults where the user gave none; return what changed."""
    changed: dict[str, Any] = {}
    if engine_args.enable_prefix_caching is None:
        changed["enable_prefix_caching"] = True
    if (
        is_cpu_build()
        and engine_args.kv_cache_memory_bytes is None
        and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    ):
        changed["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_CACHE_BYTES
    for key, value in changed.items():
        setattr(engine_args, key, value)
    return changed
