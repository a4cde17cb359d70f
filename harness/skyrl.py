"""SkyRL's released client (``skyrl`` 0.4.0 on PyPI), unchanged, on this Python.

SkyRL drives inference servers it did not start through two classes:
``RemoteInferenceClient`` (generation through a router, control fanned out to
every server) and ``SkyrlWeightSyncClient`` (the weight-transfer control plane
vLLM's trainer engines call). Tests run those very files against our fleet, so
what they prove is what a SkyRL user gets.

``make skyrl-deps`` puts the wheel into ``.skyrl/`` (git-ignored) with
``--no-deps --ignore-requires-python``, and the two packages its client imports
that our environment lacks (``orjson``; ``cloudpathlib``, through
``skyrl/backends/__init__.py``). Its metadata asks for Python >= 3.12, where
these machines have 3.11; the files themselves are 3.11 code
(``syntax_errors_here`` compiles every one), and one import fails here, at
class creation, not in the client: ``skyrl/tinker/types.py`` (the Tinker API's
types, pulled in by ``skyrl.backends``'s package import) declares a pydantic
field with ``typing.TypedDict``, which pydantic refuses below 3.12 (the
standard library's TypedDict gained what pydantic reads, ``__orig_bases__``
among it, in 3.12), asking for ``typing_extensions.TypedDict``, its backport.
``load()`` imports that one module with ``typing.TypedDict`` set to
``typing_extensions.TypedDict`` (what pydantic asks for: for this module's one
plain TypedDict, the class 3.12's own would build), restores it, then imports
the client modules as they are. No SkyRL file is edited; the swap lasts one import
and is skipped from 3.12 on (``needs_typed_dict_workaround`` checks, in a fresh
interpreter, that the import still fails without it).

``load()`` raises ``SkyrlMissing`` where ``make skyrl-deps`` has not run, so a
plain ``pytest`` skips those tests with that reason; ``make test`` always
installs it first.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness import ROOT

SKYRL_DIR = ROOT / ".skyrl"
SKYRL_VERSION = "0.4.0"
# The one module whose import needs the TypedDict of Python >= 3.12.
_TYPED_DICT_MODULE = "skyrl.tinker.types"
_CLIENT = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
_CONTROL_PLANE = "skyrl.backends.skyrl_train.weight_sync.control_plane"


class SkyrlMissing(RuntimeError):
    """``.skyrl/`` does not hold the pinned release: run ``make skyrl-deps``."""


@dataclass(frozen=True)
class Skyrl:
    """The released modules a trainer's driver and its rank 0 import."""

    remote_inference_client: ModuleType  # RemoteInferenceClient
    control_plane: ModuleType  # SkyrlWeightSyncClient, nccl_init_payloads


def missing_reason() -> str | None:
    """Why ``load()`` would fail here, or None when the pinned release is installed."""
    if not (SKYRL_DIR / f"skyrl-{SKYRL_VERSION}.dist-info").is_dir():
        return f"skyrl {SKYRL_VERSION} is not installed in {SKYRL_DIR} (make skyrl-deps)"
    return None


def load() -> Skyrl:
    """SkyRL's client modules, imported from ``.skyrl/`` (the workaround above
    applied to its one import, once per process)."""
    reason = missing_reason()
    if reason is not None:
        raise SkyrlMissing(reason)
    if str(SKYRL_DIR) not in sys.path:
        sys.path.append(str(SKYRL_DIR))  # after the environment: ours win any overlap
    if sys.version_info < (3, 12) and _TYPED_DICT_MODULE not in sys.modules:
        _import_with_backported_typed_dict(_TYPED_DICT_MODULE)
    return Skyrl(importlib.import_module(_CLIENT), importlib.import_module(_CONTROL_PLANE))


def needs_typed_dict_workaround() -> bool:
    """Whether SkyRL's client still fails to import here without the swap (checked
    in a fresh interpreter: once an import succeeds, the workaround must go)."""
    code = (
        f"import sys; sys.path.append({str(SKYRL_DIR)!r})\n"
        "try:\n"
        f"    import {_CLIENT}\n"
        "except Exception as e:\n"
        "    print(repr(e), file=sys.stderr)\n"
        "    sys.exit(0 if 'typing_extensions.TypedDict' in str(e) else 2)\n"
        "sys.exit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"SkyRL's client failed otherwise: {done.stderr.decode()[-2000:]}")
    return done.returncode == 0


def _import_with_backported_typed_dict(name: str) -> None:
    """Import ``name`` while ``typing.TypedDict`` is ``typing_extensions``' (pydantic's
    own advice below 3.12). pydantic and typing_extensions are imported before the
    swap, so only the classes ``name`` itself defines are built with it."""
    import pydantic  # noqa: F401  (its own TypedDicts: built before the swap)
    import typing_extensions

    saved = typing.TypedDict
    setattr(typing, "TypedDict", typing_extensions.TypedDict)  # noqa: B010
    try:
        importlib.import_module(name)
    finally:
        setattr(typing, "TypedDict", saved)  # noqa: B010


def syntax_errors_here() -> list[str]:
    """Every ``.py`` file of the installed ``skyrl`` package that this Python cannot
    compile (the claim behind ``--ignore-requires-python``)."""
    errors = []
    for path in sorted(Path(SKYRL_DIR, "skyrl").rglob("*.py")):
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as e:
            errors.append(f"{path.relative_to(SKYRL_DIR)}:{e.lineno}: {e.msg}")
    return errors
