"""Make some imports fail in a child process: put this folder on PYTHONPATH and
name the top-level packages in BLOCKED_IMPORTS (comma-separated).

Used to prove the dependency rule at runtime (the bridge runs with vllm and
torch blocked, the engine server with dynamo and bridge blocked) and that the
suite collects where vLLM is not installed.

Two locks: a meta-path finder in front of all others, and the path finder
itself, for hooks that get in front of ours later and look files up through it
(pytest's assertion rewriter does, for packages it was told to rewrite).
"""

import os
import sys
from importlib.machinery import PathFinder

_BLOCKED = frozenset(p for p in os.environ.get("BLOCKED_IMPORTS", "").split(",") if p)


def _check(name: str) -> None:
    # ModuleNotFoundError, as for a package that is not installed (what
    # pytest.importorskip skips on, and `except ImportError` still catches).
    if name.partition(".")[0] in _BLOCKED:
        raise ModuleNotFoundError(
            f"import of {name!r} is blocked in this process (BLOCKED_IMPORTS)", name=name
        )


class _Blocker:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        _check(name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
    _path_find_spec = PathFinder.find_spec

    def _find_spec(cls, name, path=None, target=None):  # type: ignore[no-untyped-def]
        _check(name)
        return _path_find_spec(name, path, target)

    PathFinder.find_spec = classmethod(_find_spec)  # type: ignore[method-assign,assignment]
