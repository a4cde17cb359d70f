"""Item 6: contract-revision skew between real processes.

The contract supports its last two revisions (docs/contract.md, "Supported
revisions"). A bridge and an engine server outside each other's window refuse
each other, the bridge exiting 1 with a message that says which side to upgrade;
inside it they serve. The other revision comes from
tests/faults/skewed_revision.py, which runs the unchanged program with
engine_contract's revision constants overridden.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

import engine_contract
from harness import ROOT
from harness.http import HttpOutcome, http_json, post_stream, stream_body
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

SKEWED = (str(ROOT / "tests" / "faults" / "skewed_revision.py"),)


def skew(contract: int) -> dict[str, str]:
    """A process of revision ``contract``, with that revision's window: it and the
    one before."""
    return {
        "SKEW_CONTRACT_REVISION": str(contract),
        "SKEW_MINIMUM_CLIENT_REVISION": str(contract - 1),
        "SKEW_MINIMUM_SERVER_REVISION": str(contract - 1),
    }


# Revisions relative to this build's, so that the tests outlive the next bump.
NOW = engine_contract.CONTRACT_REVISION
NEXT = NOW + 1
OLDEST_SERVER = engine_contract.MINIMUM_SERVER_REVISION
OLDEST_CLIENT = engine_contract.MINIMUM_CLIENT_REVISION


@pytest.mark.parametrize(
    ("server", "bridge", "message"),
    [
        pytest.param(
            skew(OLDEST_SERVER - 1),
            {},
            f"implements contract revision {OLDEST_SERVER - 1}, but this bridge needs at "
            f"least revision {OLDEST_SERVER}: upgrade the engine server",
            id="server-older-than-the-window",
        ),
        pytest.param(
            {},
            skew(OLDEST_CLIENT - 1),
            f"client_revision {OLDEST_CLIENT - 1} is older than this server accepts (minimum "
            f"{OLDEST_CLIENT}, server revision {NOW}); upgrade the client",
            id="bridge-older-than-the-window",
        ),
    ],
)
def test_revisions_outside_the_window_are_refused(
    tmp_path: Path, model_dir: Path, server: dict[str, str], bridge: dict[str, str], message: str
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "tiny-skew")
        _, address = stack.start_engine("engine", env=server, launcher=SKEWED)
        proc = stack.start_bridge("bridge", address, launcher=SKEWED, **bridge)
        assert proc.wait_exit(60) == 1
        log = proc.log_tail(20_000)
        assert message in log, log


@pytest.mark.parametrize(
    ("server", "bridge", "server_revision"),
    [
        pytest.param(skew(NEXT), {}, NEXT, id="newer-server-accepts-older-bridge"),
        pytest.param({}, skew(NEXT), NOW, id="newer-bridge-accepts-older-server"),
        pytest.param(skew(OLDEST_SERVER), {}, OLDEST_SERVER, id="oldest-server-in-the-window"),
    ],
)
def test_revisions_inside_the_window_serve(
    tmp_path: Path,
    model_dir: Path,
    server: dict[str, str],
    bridge: dict[str, str],
    server_revision: int,
) -> None:
    model = "tiny-skew-ok"
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, model)
        _, address = stack.start_engine("engine", env=server, launcher=SKEWED)
        proc = stack.start_bridge("bridge", address, launcher=SKEWED, **bridge)
        stack.start_frontend()
        stack.wait_serving()
        status, body = http_json(
            f"{stack.base_url}/v1/completions",
            driver.build_rollout_body(model, [5, 6, 7, 8], greedy=True, max_tokens=3),
        )
        assert status == 200, body
        assert len(driver.parse_rollout_response(body).token_ids) == 3
        assert f", contract {server_revision}), " in proc.log_tail(100_000)
        outcome = asyncio.run(streamed(stack.base_url, model))
        assert outcome.status == 200 and outcome.stream_error_code is None, outcome
        log = proc.log_tail(100_000)
        assert "rollouts multiplexed" in log and "completions multiplexed" in log


async def streamed(base_url: str, model: str) -> HttpOutcome:
    async with aiohttp.ClientSession() as session:
        return await post_stream(
            session, f"{base_url}/v1/completions", stream_body(model, [5, 6, 7, 8], 6)
        )
