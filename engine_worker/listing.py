"""Each side's flags, asked of a child process; the engine side's child then kept,
to become the engine server.

The bridge's listing (``python -m engine_worker.flags bridge``) is a child that
prints and exits. The engine server's (``... engine BACKEND --serve``) imports
vLLM to build its parser, the seconds of CPU an engine server's start spends
before vLLM's own: rather than have the engine server import it all again, the
child, once it has printed, waits for its engine server's arguments on stdin
and serves them in the same process (``Listed.hand_over``). It is started as the
supervisor starts the engine server, in a session of its own with the
parent-death signal armed and its output piped, so the supervisor adopts it as
the engine server's first run (``launch.supervisor.ChildProcess(first=...)``);
its restarts are ``python -m engine_server`` as before. One that is not handed
over (a command line refused, ``--dry-run``, a stop during start-up) is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine_worker.flags import MARKER, SERVE, Arity
from engine_worker.split import UsageError
from launch.parent_death import death_signal_setter

# A side's parser imports vLLM or Dynamo: seconds, rarely minutes.
LISTING_TIMEOUT_S = 300.0
# The listing is one line of JSON (vLLM's parser: a few hundred options).
_LINE_LIMIT = 1 << 22


@dataclass
class Listed:
    """A side's listing child; the engine side's (``--serve``), kept running,
    waits for its engine server's arguments on stdin."""

    process: asyncio.subprocess.Process
    # Its stdout lines before the listing (what its imports printed), for the
    # supervisor to pass on as the engine server's.
    early: list[bytes] = field(default_factory=list)
    handed: bool = False

    async def hand_over(self, engine_args: Sequence[str]) -> bool:
        """Send the arguments (those after ``python -m engine_server``); False when
        the child is gone and the engine server must be started afresh."""
        stdin = self.process.stdin
        if self.process.returncode is not None or stdin is None:
            return False
        try:
            stdin.write(json.dumps(list(engine_args)).encode() + b"\n")
            await stdin.drain()
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            await self.discard()
            return False
        self.handed = True
        return True

    async def discard(self) -> None:
        """Kill it unless it was handed over (idempotent)."""
        if self.handed:
            return
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


def _what(side: str, backend: str | None) -> str:
    if side == "engine":
        return f"the engine server's flags (backend {backend})"
    return "the bridge's flags"


async def _spawn(
    python: str, side: str, backend: str | None, env: Mapping[str, str], serve: bool
) -> asyncio.subprocess.Process:
    argv = [python, "-m", "engine_worker.flags", side, *([backend] if backend else [])]
    try:
        # In a session of its own, as the children are: a ``killpg`` of the
        # launcher's group stops the launcher, which kills it.
        return await asyncio.create_subprocess_exec(
            *argv,
            *([SERVE] if serve else []),
            env=dict(env),
            stdin=asyncio.subprocess.PIPE if serve else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=death_signal_setter(),
            limit=_LINE_LIMIT,
        )
    except OSError as e:
        raise UsageError(f"listing {_what(side, backend)} failed: {e}") from None


async def _read_listing(listed: Listed, what: str) -> dict[str, Arity]:
    """Its stdout up to the marked listing (earlier lines kept in ``early``); at its
    end without one, its stderr in the error."""
    process = listed.process
    assert process.stdout is not None and process.stderr is not None
    try:
        while line := await process.stdout.readline():
            text = line.decode(errors="replace")
            if text.startswith(MARKER):
                listing: dict[str, Arity] = json.loads(text[len(MARKER) :])
                return listing
            listed.early.append(line.rstrip(b"\n"))
    except ValueError as e:  # a line past the limit, or a listing that is not JSON
        raise UsageError(f"listing {what} failed: unreadable output ({e})") from None
    err = (await process.stderr.read()).decode(errors="replace").strip()[-2000:]
    raise UsageError(f"listing {what} failed (exit {await process.wait()}): {err}")


async def _asked(
    python: str, side: str, backend: str | None, env: Mapping[str, str], serve: bool
) -> tuple[dict[str, Arity], Listed]:
    """One side's listing, and its child: killed on any failure or a stop."""
    what = _what(side, backend)
    listed = Listed(await _spawn(python, side, backend, env, serve))
    try:
        listing = await asyncio.wait_for(_read_listing(listed, what), LISTING_TIMEOUT_S)
    except TimeoutError:
        await listed.discard()
        raise UsageError(f"listing {what} failed: no answer in {LISTING_TIMEOUT_S:.0f}s") from None
    except BaseException:  # refused, or the worker is stopping
        await listed.discard()
        raise
    return listing, listed


async def known_flags(
    python: str, side: str, backend: str | None, env: Mapping[str, str]
) -> dict[str, Arity]:
    """The flags one side's own parser knows, from a child that then exits."""
    listing, listed = await _asked(python, side, backend, env, serve=False)
    try:
        await listed.process.wait()
    finally:
        await listed.discard()  # the worker is stopping: no wait for its exit
    return listing


async def engine_flags_kept(
    python: str, backend: str, env: Mapping[str, str]
) -> tuple[dict[str, Arity], Listed]:
    """The engine server's flags, and the child that listed them, kept running."""
    return await _asked(python, "engine", backend, env, serve=True)


async def both_known_flags(
    engine_python: str,
    backend: str,
    bridge_python: str,
    e_env: Mapping[str, str],
    b_env: Mapping[str, str],
) -> tuple[dict[str, Arity], Listed, dict[str, Arity]]:
    """Both listings, asked at the same time (the engine's imports vLLM: seconds);
    when one fails or the worker stops, the other is given up too, and the
    engine's child killed."""
    engine = asyncio.ensure_future(engine_flags_kept(engine_python, backend, e_env))
    bridge = asyncio.ensure_future(known_flags(bridge_python, "bridge", None, b_env))
    try:
        await asyncio.wait({engine, bridge}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (engine, bridge):
            if task.done():
                task.result()  # the first failure, raised at once
        engine_flags, listed = engine.result()
        bridge_flags = bridge.result()
    except BaseException:
        for task in (engine, bridge):
            task.cancel()
        results = await asyncio.gather(engine, bridge, return_exceptions=True)
        if isinstance(results[0], tuple):  # listed just before the other failed
            await results[0][1].discard()
        raise
    return engine_flags, listed, bridge_flags


def write_early(listed: Listed, prefix: str) -> None:
    """Its imports' stdout lines, passed on as the engine server's would be."""
    for line in listed.early:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(prefix.encode() + line + b"\n")
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.buffer.flush()
