"""One command line, two programs: which argument goes where.

The launcher is given the command line NeMo RL builds for ``python -m
dynamo.vllm``. Each argument goes to the side whose parser knows it (the
listings come from the parsers themselves, see ``engine_worker.flags``):

- a flag only the engine server knows (vLLM's engine arguments: ``--seed``,
  ``--trust-remote-code``, ``--weight-transfer-config``, ``--max-model-len``
  ...; the server's own) goes to the engine server;
- a flag only the bridge knows (Dynamo's runtime and worker arguments:
  ``--namespace``, ``--discovery-backend``, ``--request-plane``,
  ``--event-plane``, ``--enable-rl``, ``--endpoint-types``,
  ``--custom-jinja-template``, ``--dyn-tool-call-parser`` ...; the bridge's
  own) goes to the bridge;
- a flag both know goes to both (``--served-model-name``, ``--log-level``);
  ``--model`` goes to the engine server, and the bridge gets the same model as
  ``--model-path``;
- the flags the launcher sets itself (``--listen``, ``--ready-file``,
  ``--engine``, ``--model-path``) and anything neither side knows are refused,
  by name.

Values are taken as argparse would take them, from each flag's arity (a switch
takes none, ``--flag=value`` carries its own), so a value is never mistaken
for a flag or the other way round. Abbreviations are not accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine_worker.flags import Arity

# What the launcher itself sets on each child: given by the user, refused.
MANAGED = {
    "--listen": "the engine server listens on a unix socket in a private folder",
    "--ready-file": "the launcher does not wait for the engine server",
    "--engine": "the bridge reaches the engine server's private unix socket",
    "--model-path": "the bridge's model folder is --model's",
}
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class UsageError(ValueError):
    """A command line the launcher refuses (exit 2)."""


@dataclass
class Split:
    """The arguments of each side, in the order given; ``own``: the launcher's."""

    engine: list[str] = field(default_factory=list)
    bridge: list[str] = field(default_factory=list)
    own: list[str] = field(default_factory=list)
    model: str | None = None
    served_model_name: str | None = None


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


def _lookup(token: str, tables: Sequence[Mapping[str, Arity]]) -> tuple[str, str | None]:
    """(option, attached value or None): ``--flag=value`` and ``-Ovalue`` forms."""
    if token.startswith("--"):
        name, eq, value = token.partition("=")
        return name, (value if eq else None)
    if any(token in t for t in tables) or len(token) <= 2:
        return token, None
    short = token[:2]
    if any(short in t for t in tables):
        return short, token[2:].removeprefix("=")
    return token, None


def _take(argv: Sequence[str], i: int, name: str, arity: Arity) -> tuple[list[str], int]:
    """The values of ``name`` starting at ``argv[i]``, and the index after them."""
    if arity == 0:
        return [], i
    if isinstance(arity, int):
        values = list(argv[i : i + arity])
        if len(values) < arity or any(_is_option(v) for v in values):
            raise UsageError(f"{name} expects {arity} value{'s' if arity > 1 else ''}")
        return values, i + arity
    values = []
    while i < len(argv) and not _is_option(argv[i]):
        values.append(argv[i])
        i += 1
        if arity == "?":
            break
    if arity == "+" and not values:
        raise UsageError(f"{name} expects at least one value")
    return values, i


def split_args(
    argv: Sequence[str],
    engine: Mapping[str, Arity],
    bridge: Mapping[str, Arity],
    own: Mapping[str, Arity] | None = None,
    engine_name: str = "the engine server",
) -> Split:
    """Route each argument of ``argv`` to the side(s) knowing it; raises UsageError
    naming the first argument no side accepts."""
    own = own or {}
    out = Split()
    i = 0
    while i < len(argv):
        token = argv[i]
        if not _is_option(token):
            raise UsageError(
                f"unexpected argument {token!r}: every argument is a --flag (and its values)"
            )
        name, attached = _lookup(token, (own, engine, bridge))
        in_own, in_engine, in_bridge = name in own, name in engine, name in bridge
        if name in MANAGED and not in_own:
            raise UsageError(f"{name} is set by the launcher ({MANAGED[name]}); do not pass it")
        if not (in_own or in_engine or in_bridge):
            raise UsageError(
                f"unrecognized argument {name}: neither {engine_name} nor the bridge "
                "(Dynamo's worker arguments) accepts it"
            )
        arity = own[name] if in_own else engine[name] if in_engine else bridge[name]
        if attached is not None:
            if arity == 0:
                raise UsageError(f"{name} takes no value (got {token!r})")
            values, i = [attached], i + 1
        else:
            values, i = _take(argv, i + 1, name, arity)
        given = [token] if attached is not None else [token, *values]
        if in_own:
            out.own += given
            continue
        if name == "--model":
            if not values or not values[0].strip():  # "": the current folder, never meant
                raise UsageError(f"{name} is empty: give a model folder or a Hugging Face Hub name")
            out.model = values[0]
        if name == "--served-model-name" and values:
            out.served_model_name = values[0]
        if in_engine:
            out.engine += given
        if in_bridge:
            if attached is None and bridge[name] == 1 and len(values) > 1:
                given = [token, values[0]]  # vLLM takes several names, Dynamo one
            out.bridge += given
    return out
