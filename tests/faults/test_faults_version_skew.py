"""Item 6: contract-revision skew between real processes.

A bridge refuses an engine server it cannot use, in both directions, exiting 1
with a message that says which side to upgrade; compatible revisions serve.
The other revision comes from tests/faults/skewed_revision.py, which runs the
unchanged program with engine_contract's revision constants overridden.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

import engine_contract
from harness import ROOT
from harness.http import Outcome, http_json, post_stream, stream_body
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

SKEWED = (str(ROOT / "tests" / "faults" / "skewed_revision.py"),)


def skew(contract: int, min_client: int = 1, min_server: int = 1) -> dict[str, str]:
    return {
        "SKEW_CONTRACT_REVISION": str(contract),
        "SKEW_MINIMUM_CLIENT_REVISION": str(min_client),
        "SKEW_MINIMUM_SERVER_REVISION": str(min_server),
    }


# Revisions relative to this build's, so that the tests outlive the next bump.
NOW = engine_contract.CONTRACT_REVISION
NEXT = NOW + 1


@pytest.mark.parametrize(
    ("server", "bridge", "message"),
    [
        pytest.param(
            {},
            skew(NEXT, min_server=NEXT),
            f"implements contract revision {NOW}, but this bridge needs at least revision "
            f"{NEXT}: upgrade the engine server",
            id="server-too-old",
        ),
        pytest.param(
            skew(NEXT, min_client=NEXT),
            {},
            f"client_revision {NOW} is older than this server accepts (minimum {NEXT}, server "
            f"revision {NEXT}); upgrade the client",
            id="bridge-too-old",
        ),
    ],
)
def test_incompatible_revisions_are_refused(
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
    ("server", "bridge", "server_revision", "rollouts", "completions"),
    [
        pytest.param(
            skew(NEXT),
            {},
            NEXT,
            "multiplexed",
            "multiplexed",
            id="newer-server-accepts-older-bridge",
        ),
        pytest.param(
            {},
            skew(NEXT),
            NOW,
            "multiplexed",
            "multiplexed",
            id="newer-bridge-accepts-older-server",
        ),
        # A revision-3 server has no Generates stream: one Generate call each.
        pytest.param(
            skew(3), {}, 3, "multiplexed", "one call each", id="completions-fall-back-to-unary"
        ),
        # A revision-1 server has no Rollouts stream: one Rollout call each.
        pytest.param(
            skew(1), {}, 1, "one call each", "one call each", id="bridge-falls-back-to-unary"
        ),
    ],
)
def test_compatible_revisions_serve(
    tmp_path: Path,
    model_dir: Path,
    server: dict[str, str],
    bridge: dict[str, str],
    server_revision: int,
    rollouts: str,
    completions: str,
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
        assert f"rollouts {rollouts}" in log and f"completions {completions}" in log


async def streamed(base_url: str, model: str) -> Outcome:
    async with aiohttp.ClientSession() as session:
        return await post_stream(
            session, f"{base_url}/v1/completions", stream_body(model, [5, 6, 7, 8], 6)
        )
