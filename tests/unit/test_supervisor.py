"""The one supervisor (launch.supervisor) of engine_server.host's bridge and
engine_worker's two children: restarts, what restarting cannot help, output into
a host's logging, and stops."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

from launch.supervisor import (
    START_FAILED,
    USAGE_ERROR,
    ChildProcess,
    IntoLogging,
    PassThrough,
    RestartPolicy,
)

pytestmark = pytest.mark.serial

FAST = RestartPolicy(initial_s=0.05, max_s=0.05, jitter=0)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def until(condition: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def restarted(name: str, exit_code: int, times: int) -> None:
    """A child exiting ``exit_code`` at once is restarted ``times`` times (then stopped)."""
    child = ChildProcess(
        name, python(f"raise SystemExit({exit_code})"), {}, output=PassThrough(), restart=FAST
    )
    child.start()
    await until(lambda: child.restarts >= times)
    await child.stop(5)


async def test_output_reaches_the_hosts_logging_at_its_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="test.child")
    code = (
        "import sys; print('\\x1b[1mWARNING\\x1b[0m careful', flush=True); "
        "print('plain', file=sys.stderr, flush=True)"
    )
    child = ChildProcess(
        "child",
        python(code + "; import time; time.sleep(30)"),
        {},
        output=IntoLogging(logging.getLogger("test.child")),
        restart=FAST,
    )
    child.start()
    await child.wait_started()
    pid = child.pid
    await until(lambda: len([r for r in caplog.records if r.name == "test.child"]) >= 2)
    await child.stop(5)
    lines = {(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.child"}
    assert (logging.WARNING, f"[child {pid}] WARNING careful") in lines
    assert (logging.INFO, f"[child {pid}] plain") in lines
    assert child.pid is None and child.restarts == 0


async def test_a_child_that_dies_is_restarted_and_counted() -> None:
    await restarted("child", 3, times=2)


async def test_a_refused_command_line_is_fatal_only_where_the_owner_asks() -> None:
    fatal: list[int] = []
    asked = ChildProcess(
        "asked", python("raise SystemExit(2)"), {}, output=PassThrough(), restart=FAST,
        on_fatal=fatal.append,
    )  # fmt: skip
    asked.start()
    await until(lambda: fatal == [USAGE_ERROR])
    await asyncio.sleep(0.3)
    assert asked.restarts == 0
    await asked.stop(5)
    # A host's bridge: refusing its arguments, it is still restarted.
    await restarted("kept", USAGE_ERROR, times=1)


async def test_a_first_start_that_fails_is_the_owners_to_hear() -> None:
    fatal: list[int] = []
    child = ChildProcess(
        "missing", ["/nonexistent/program"], {}, output=PassThrough(), on_fatal=fatal.append
    )
    child.start()
    with pytest.raises(FileNotFoundError):
        await child.wait_started()
    assert fatal == [START_FAILED]
    await child.stop(5)


async def test_stop_kills_a_child_that_will_not_stop() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"  # noqa: E501
    seen: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("test.stubborn")
    logger.setLevel(logging.INFO)
    logger.addHandler(Lines())
    child = ChildProcess("stubborn", python(code), {}, output=IntoLogging(logger), restart=FAST)
    child.start()
    await until(lambda: any("up" in line for line in seen))
    started = time.monotonic()
    await child.stop(0.5)
    assert time.monotonic() - started < 5 and child.pid is None


async def test_a_child_spawned_as_stop_is_called_is_stopped_too() -> None:
    """stop() (or a signal handler's terminate()) landing while the process is being
    spawned: the new child is signalled once it exists and stop() waits for it, so
    none is left running for its parent-death signal to end."""
    spawned: list[int] = []
    child = ChildProcess("late", python("import time; time.sleep(60)"), {}, output=PassThrough())
    spawn = child._spawn

    async def slow_spawn() -> asyncio.subprocess.Process:
        await asyncio.sleep(0.3)  # stop() comes in here
        process = await spawn()
        spawned.append(process.pid)
        return process

    child._spawn = slow_spawn  # type: ignore[method-assign]
    child.start()
    await asyncio.sleep(0.1)
    await child.stop(5)
    assert spawned and child.process is not None and child.process.returncode is not None
    assert child.pid is None and child.restarts == 0


async def adoptable(code: str) -> asyncio.subprocess.Process:
    """A process started as the supervisor starts one (PassThrough's pipes)."""
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        *python(code), stdin=asyncio.subprocess.DEVNULL, stdout=pipe, stderr=pipe
    )


async def test_an_adopted_first_run_is_supervised_and_restarts_run_the_command() -> None:
    first = await adoptable("raise SystemExit(3)")
    sleeper = python("import time; time.sleep(30)")
    child = ChildProcess("child", sleeper, {}, output=PassThrough(), restart=FAST, first=first)
    child.start()
    await child.wait_started()
    await until(lambda: child.restarts == 1 and child.pid is not None)
    assert first.returncode == 3 and child.pid != first.pid  # the restart: argv
    await child.stop(5)


async def test_an_adopted_first_run_that_refuses_its_arguments_is_fatal() -> None:
    fatal: list[int] = []
    first = await adoptable(f"raise SystemExit({USAGE_ERROR})")
    child = ChildProcess(
        "child", python("pass"), {}, output=PassThrough(), on_fatal=fatal.append, first=first
    )
    child.start()
    await until(lambda: fatal == [USAGE_ERROR])
    assert child.restarts == 0
    await child.stop(5)


async def test_an_adopted_process_stopped_before_its_supervisor_ran_is_stopped() -> None:
    first = await adoptable("import time; time.sleep(30)")
    child = ChildProcess("child", python("pass"), {}, output=PassThrough(), first=first)
    assert child.pid == first.pid
    await child.stop(5)  # never started
    assert first.returncode is not None


async def test_an_adopted_process_needs_its_stderr_apart() -> None:
    first = await adoptable("pass")
    with pytest.raises(ValueError, match="not merged"):
        ChildProcess(
            "child",
            python("pass"),
            {},
            output=IntoLogging(logging.getLogger("test.child")),
            first=first,
        )
    await first.wait()


async def test_after_exit_runs_after_each_run_before_the_next_starts() -> None:
    """What a run left behind is cleared before the next run can leave its own: each
    ``after_exit`` sees the run before it gone and its successor not yet started;
    one that fails does not stop the restarts."""
    seen: list[tuple[int, int | None, int]] = []
    child: ChildProcess

    async def after_exit(code: int) -> None:
        seen.append((code, child.pid, child.restarts))
        if len(seen) == 1:
            raise RuntimeError("etcd did not answer")

    child = ChildProcess(
        "child",
        python("raise SystemExit(3)"),
        {},
        output=PassThrough(),
        restart=FAST,
        after_exit=after_exit,
    )
    child.start()
    await until(lambda: len(seen) >= 3)
    await child.stop(5)
    assert seen[:3] == [(3, None, 0), (3, None, 1), (3, None, 2)], seen
