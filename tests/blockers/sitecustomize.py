"""Make some imports fail in a child process: put this folder on PYTHONPATH and
name the top-level packages in BLOCKED_IMPORTS (comma-separated).

Used to prove the dependency rule at runtime: the bridge runs with vllm and
torch blocked, the engine server with dynamo and bridge blocked.
"""

import os
import sys

_BLOCKED = frozenset(p for p in os.environ.get("BLOCKED_IMPORTS", "").split(",") if p)


class _Blocker:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in _BLOCKED:
            raise ImportError(f"import of {name!r} is blocked in this process (BLOCKED_IMPORTS)")
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
