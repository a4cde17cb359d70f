"""Command-line flags from config dataclasses: a setting's default, type and help
are written once, on its field, and both processes' parsers are built from them.

The unit rule both processes follow: a duration's flag ends in ``-s`` (seconds)
or ``-ms`` (milliseconds), a size's in ``-bytes``; the field carries the same
suffix (``grace_period_s``, ``max_message_bytes``), so the flag is the field's
name. Old spellings stay accepted for a while, each with a warning naming the
new flag (printed once, to stderr: logging is not set up while flags parse).

A field becomes a flag when its metadata has a help text::

    timeout_s: float = field(default=60.0, metadata=flag("the longest ..."))

``add_fields`` adds a dataclass's flags to a parser or group and ``from_args``
reads them back as the dataclass's keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

_KEY = "cli"


@dataclasses.dataclass(frozen=True)
class _Spec:
    help: str
    flag: str | None
    off: bool
    old: tuple[str, ...]
    type: Callable[[str], Any] | None
    metavar: str | None
    choices: tuple[str, ...] | None


def flag(
    help: str,
    *,
    name: str | None = None,
    off: bool = False,
    old: Sequence[str] = (),
    type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Field metadata making the field a flag.

    ``name``: the flag when it is not ``--`` + prefix + the field's name dashed.
    ``off``: the field is optional and 0 on the command line means None (off).
    ``old``: earlier spellings, still accepted with a deprecation warning.
    ``type``: parses the text when the field's annotation does not say how.
    """
    spec = _Spec(help, name, off, tuple(old), type, metavar, tuple(choices) if choices else None)
    return {_KEY: spec}


def _specs(
    cls: type, prefix: str, only: Collection[str] | None
) -> Iterable[tuple[dataclasses.Field[Any], _Spec, str, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None or (only is not None and f.name not in only):
            continue
        name = spec.flag or "--" + prefix + f.name.replace("_", "-")
        yield f, spec, name, hints[f.name]


def _dest(name: str) -> str:
    return name.removeprefix("--").replace("-", "_")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: it cannot be a flag")


def _element_type(hint: Any) -> tuple[Any, bool]:
    """The type of one value, and whether the field is a tuple of them."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _env_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")  # as Dynamo reads them


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    env_prefix: str | None = None,
) -> None:
    """Add ``cls``'s flags (its fields with ``flag`` metadata, ``only`` those
    named if given) to ``parser``.

    ``prefix`` goes before each derived flag name (``refit-``); with
    ``env_prefix`` each flag also reads an environment variable, the prefix
    then the flag's name upper-cased (``BRIDGE_`` + ``--abort-timeout-s``:
    ``BRIDGE_ABORT_TIMEOUT_S``), as Dynamo's own flags do.
    """
    for f, spec, name, hint in _specs(cls, prefix, only):
        element, repeated = _element_type(hint)
        default = _default(f)
        if spec.off and default is None:
            default = 0
        kwargs: dict[str, Any] = {"dest": _dest(name)}
        if element is bool and not repeated:
            kwargs.update(action="store_true", default=default)
        else:
            parse = spec.type or element
            kwargs.update(type=parse, metavar=spec.metavar, choices=spec.choices)
            if repeated:
                kwargs.update(action="append", default=list(default))
            else:
                kwargs["default"] = default
        help_text = spec.help
        if spec.old:
            help_text += f" (formerly {', '.join(spec.old)}, still accepted)"
        if env_prefix is not None:
            env = env_prefix + _dest(name).upper()
            if env in os.environ:
                kwargs["default"] = kwargs.get("type", _env_bool)(os.environ[env])
            help_text += f"\nenv var: {env} | default: {default}"
        elif element is not bool and not repeated:
            help_text += " (default: %(default)s)"
        kwargs["help"] = help_text
        parser.add_argument(name, **kwargs)
        for old in spec.old:
            add_deprecated(parser, old, name, dest=kwargs["dest"], type=kwargs.get("type", str))


def from_args(
    args: argparse.Namespace,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
) -> dict[str, Any]:
    """``cls``'s keyword arguments from the flags ``add_fields`` added."""
    values: dict[str, Any] = {}
    for f, spec, name, _ in _specs(cls, prefix, only):
        value = getattr(args, _dest(name))
        if isinstance(value, list):
            value = tuple(value)
        elif spec.off and value == 0:
            value = None
        values[f.name] = value
    return values


_warned: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
    """Say once per process that ``old`` is spelled ``new`` now."""
    if old in _warned:
        return
    _warned.add(old)
    print(
        f"warning: {old} is deprecated and will be removed; use {new}",
        file=sys.stderr,
        flush=True,
    )


def add_deprecated(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    old: str,
    new: str,
    *,
    dest: str,
    type: Callable[[str], Any] = str,
) -> None:
    """Accept ``old`` as a hidden spelling of the flag ``new`` that takes a value
    (same ``dest``), warning once when it is used. ``type`` parses its value into
    the new flag's unit."""

    class _Deprecated(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: str | Sequence[Any] | None,
            option_string: str | None = None,
        ) -> None:
            warn_deprecated(old, new)
            setattr(namespace, self.dest, values)

    parser.add_argument(
        old,
        dest=dest,
        type=type,
        action=_Deprecated,
        help=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
    )


def deprecated_env(
    environ: Mapping[str, str], old: str, new: str, convert: Callable[[str], Any] = str
) -> Any:
    """The value of the old environment variable ``old`` (converted to the new
    one's unit, with a warning) when only it is set; None otherwise (the new
    variable, read where its flag is added, wins)."""
    if old not in environ or new in environ:
        return None
    warn_deprecated(old, new)
    return convert(environ[old])
