"""Command-line flags from config dataclasses: a setting's flag, default, type,
unit, environment variable and help are written once, on its field, and a
program's parser, its config and (for a supervisor) its command line are all
built from them.

The unit rule both programs follow: a duration's flag ends in ``-s`` (seconds)
or ``-ms`` (milliseconds), a size's in ``-bytes``; the field carries the same
suffix (``grace_period_s``, ``max_message_bytes``), so the flag is the field's
name. The check of a value is the dataclass's own (``__post_init__``), so a
config built in code and one built from flags are held to the same rules.

A field becomes a flag when its metadata has a help text::

    timeout_s: float = field(default=60.0, metadata=flag("the longest ..."))

``add_fields`` adds a dataclass's flags to a parser or group, ``from_args``
reads them back as the dataclass's keyword arguments, and ``to_argv`` writes a
config back as the flags that give its values. How the annotation reads:

- ``bool``: a switch that sets the value the default is not (``--start-paused``;
  a field that defaults to True gets a switch that turns it off, named so:
  ``--disable-kv-events``), or with ``negatable`` a ``--x``/``--no-x`` pair;
- ``tuple[T, ...]``: a repeatable flag, one T each (unless ``type`` parses the
  whole value);
- ``T | None``: a T; None is "not given" (or, with ``off``, what 0 means).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

_KEY = "cli"
# "The field's own default": a flag whose command-line default is the field's.
_FIELD_DEFAULT: Any = object()


@dataclasses.dataclass(frozen=True)
class _Spec:
    help: str
    name: str | None
    env: str | bool
    off: bool
    negatable: bool
    type: Callable[[str], Any] | None
    metavar: str | None
    choices: tuple[str, ...] | None
    # Named values (``{"on": True, "off": False}``): the flag takes a name, the
    # field gets its value.
    named: tuple[tuple[str, Any], ...] | None
    default: Any
    # Set by another parser's flag (Dynamo's): only ``to_argv`` writes it.
    external: bool = False


def flag(
    help: str,
    *,
    name: str | None = None,
    env: str | bool = True,
    off: bool = False,
    negatable: bool = False,
    type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | Mapping[str, Any] | None = None,
    default: Any = _FIELD_DEFAULT,
) -> dict[str, Any]:
    """Field metadata making the field a flag.

    ``name``: the flag when it is not ``--`` + prefix + the field's name dashed.
    ``env``: the environment variable that sets its default: by the rule of
    ``add_fields``'s ``env_prefix`` (True), this one (a name), or none (False).
    ``off``: the field is optional and 0 on the command line means None (off).
    ``negatable``: a bool field as ``--x``/``--no-x``.
    ``type``: parses the text when the field's annotation does not say how.
    ``choices``: the texts allowed, or a mapping from each text to its value.
    ``default``: the command line's default where it is not the field's (a
    config built in code may want another, said where the field is).
    """
    named = tuple(choices.items()) if isinstance(choices, Mapping) else None
    allowed = None if isinstance(choices, Mapping) or choices is None else tuple(choices)
    spec = _Spec(help, name, env, off, negatable, type, metavar, allowed, named, default)
    return {_KEY: spec}


def log_level_field(help: str) -> Any:
    """A program's ``log_level`` field: logging's level names, ``info`` by default
    (both programs take the same names; each upper-cases it for ``logging``)."""
    return dataclasses.field(
        default="info", metadata=flag(help, choices=("debug", "info", "warning", "error"))
    )


def external(name: str) -> dict[str, Any]:
    """Field metadata for a field that another parser's flag sets (Dynamo's
    ``--namespace``): ``to_argv`` writes it; ``add_fields`` and ``from_args``
    leave it to that parser."""
    spec = _Spec("", name, False, False, False, None, None, None, None, _FIELD_DEFAULT, True)
    return {_KEY: spec}


def _specs(
    cls: type, prefix: str, only: Collection[str] | None, *, externals: bool = False
) -> Iterable[tuple[dataclasses.Field[Any], _Spec, str, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None or (only is not None and f.name not in only):
            continue
        if spec.external and not externals:
            continue
        name = spec.name or "--" + prefix + f.name.replace("_", "-")
        yield f, spec, name, hints[f.name]


def _dest(name: str) -> str:
    return name.removeprefix("--").replace("-", "_")


def _cli_default(f: dataclasses.Field[Any], spec: _Spec) -> Any:
    """The flag's default: the spec's, else the field's; None for a field
    without one (a required setting: the program says so if it is not given)."""
    if spec.default is not _FIELD_DEFAULT:
        return spec.default
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _element_type(hint: Any, spec: _Spec) -> tuple[Any, bool]:
    """The type of one value, and whether the flag repeats (a tuple field)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple and spec.type is None:
        return typing.get_args(hint)[0], True
    return hint, False


def _is_switch(element: Any, repeated: bool, spec: _Spec) -> bool:
    """A flag that takes no value: a bool field's (named values take one)."""
    return element is bool and not repeated and spec.named is None


def _env_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")  # as Dynamo reads them


def _text(spec: _Spec, value: Any) -> str:
    """A value as the command line writes it (a named value by its name)."""
    for text, named in spec.named or ():
        if named == value:
            return text
    return str(value)


def _parse_named(named: Sequence[tuple[str, Any]]) -> Callable[[str], Any]:
    values = dict(named)

    def parse(text: str) -> Any:
        if text not in values:
            choices = ", ".join(map(repr, values))
            # argparse's own words for a value outside its choices.
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {choices})")
        return values[text]

    return parse


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help texts


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    env_prefix: str | None = None,
    overrides: bool = False,
) -> None:
    """Add ``cls``'s flags (its fields with ``flag`` metadata, ``only`` those
    named if given) to ``parser``.

    ``prefix`` goes before each derived flag name (``refit-``); with
    ``env_prefix`` each flag also reads an environment variable, the prefix
    then the flag's name upper-cased (``BRIDGE_`` + ``--abort-timeout-s``:
    ``BRIDGE_ABORT_TIMEOUT_S``), as Dynamo's own flags do (a repeatable one
    none); its text is read as the flag's would be. With ``overrides`` the
    flags override a config made elsewhere (a generation config file): each
    defaults to None (not given) and its help shows the field's default.
    """
    for f, spec, name, hint in _specs(cls, prefix, only):
        element, repeated = _element_type(hint, spec)
        default = _cli_default(f, spec)
        if spec.off and default is None:
            default = 0
        switch = _is_switch(element, repeated, spec)
        kwargs: dict[str, Any] = {"dest": _dest(name)}
        if switch and spec.negatable:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif switch:
            # A field that defaults to True gets a switch that turns it off: the
            # flag reads as set (``args.disable_kv_events``), the field gets False.
            kwargs.update(action="store_true", default=False)
        elif spec.named is not None:
            metavar = spec.metavar or "{" + ",".join(text for text, _ in spec.named) + "}"
            # A text default is parsed as the flag's value would be.
            kwargs.update(type=_parse_named(spec.named), metavar=metavar)
            kwargs["default"] = _text(spec, default)
        else:
            kwargs.update(type=spec.type or element, metavar=spec.metavar, choices=spec.choices)
            if repeated:
                kwargs.update(action="append", default=list(default))
            else:
                kwargs["default"] = default
        if overrides:
            kwargs["default"] = None
        env = spec.env if isinstance(spec.env, str) else None
        if spec.env is True and env_prefix is not None and not repeated:
            env = env_prefix + _dest(name).upper()
        help_text = spec.help
        if env is not None:
            if env in os.environ:
                text = os.environ[env]
                # argparse parses a text default as it parses the flag's value.
                kwargs["default"] = _env_bool(text) if switch else text
            help_text += f"\nenv var: {env} | default: {_escape(_text(spec, default))}"
        elif overrides:
            shown = _cli_default(f, spec)
            if shown is not None and shown != ():
                help_text += f" (default: {_escape(_text(spec, shown))})"
        elif not switch and not repeated and default is not None:
            help_text += " (default: %(default)s)"
        kwargs["help"] = help_text
        parser.add_argument(name, **kwargs)


def from_args(
    args: argparse.Namespace,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    overrides: bool = False,
) -> dict[str, Any]:
    """``cls``'s keyword arguments from the flags ``add_fields`` added (with
    ``overrides``: only those given)."""
    values: dict[str, Any] = {}
    for f, spec, name, hint in _specs(cls, prefix, only):
        value = getattr(args, _dest(name))
        if overrides and value is None:
            continue
        element, repeated = _element_type(hint, spec)
        if isinstance(value, list):
            value = tuple(value)
        elif _is_switch(element, repeated, spec) and not spec.negatable and _cli_default(f, spec):
            value = not value  # the switch that turns it off
        elif spec.off and value == 0:
            value = None
        values[f.name] = value
    return values


def to_argv(config: Any, *, prefix: str = "") -> list[str]:
    """The flags that give ``config``'s values, in field order: every flag field
    (``external`` ones too) but those that are None (not given: the program's
    default, or its environment, decides) and switches left at their default."""
    argv: list[str] = []
    for f, spec, name, hint in _specs(type(config), prefix, None, externals=True):
        value = getattr(config, f.name)
        if value is None:
            continue
        element, repeated = _element_type(hint, spec)
        if _is_switch(element, repeated, spec):
            if spec.negatable:
                argv.append(name if value else "--no-" + name.removeprefix("--"))
            elif value != _cli_default(f, spec):
                argv.append(name)
        elif repeated:
            for one in value:
                argv += [name, _text(spec, one)]
        elif isinstance(value, tuple):  # its ``type`` reads it; nothing here writes it
            raise TypeError(f"{name}: to_argv cannot write {value!r}")
        else:
            argv += [name, _text(spec, value)]
    return argv
