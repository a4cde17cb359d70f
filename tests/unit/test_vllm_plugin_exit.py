"""engine_server.vllm_plugin.freeze_heap_at_exit: a process vLLM starts under an
engine server (its EngineCore) freezes its heap as its last exit handler, so the
interpreter's finalization does not scan it for cycles; the engine server itself,
and a process started outside one, exit as before. Real processes; the last test
checks the entry point vLLM loads its general plugins from."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

from engine_server import vllm_plugin
from engine_server.vllm_plugin import OWNER_ENV

# Registered first, this handler runs last (atexit is LIFO): after the plugin's.
REPORT = "import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
PLUGIN = "from engine_server.vllm_plugin import freeze_heap_at_exit; freeze_heap_at_exit()"
DIRECT = REPORT + PLUGIN
# The engine server names itself before it starts vLLM, then loads the plugins too.
AS_OWNER = REPORT + f"import os; os.environ[{OWNER_ENV!r}] = str(os.getpid()); " + PLUGIN


def frozen_at_exit(program: str, owner: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    if owner is not None:
        env[OWNER_ENV] = owner
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result
    last = result.stdout.strip().splitlines()[-1]
    assert last in ("frozen True", "frozen False"), result
    return last == "frozen True"


def test_a_process_started_under_an_engine_server_freezes_its_heap_at_exit() -> None:
    assert frozen_at_exit(DIRECT, owner=str(os.getpid()))


def test_the_engine_server_itself_and_a_process_outside_one_do_not() -> None:
    assert not frozen_at_exit(AS_OWNER, owner=None)
    assert not frozen_at_exit(DIRECT, owner=None)
    assert not frozen_at_exit(DIRECT, owner="not a pid")


def test_it_is_one_of_vllms_general_plugins() -> None:
    # What vllm.plugins.load_general_plugins reads, in every process vLLM starts.
    ours = [
        e for e in entry_points(group="vllm.general_plugins") if e.module == vllm_plugin.__name__
    ]
    assert vllm_plugin.freeze_heap_at_exit in [e.load() for e in ours]
