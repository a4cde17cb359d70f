"""Item 5: a client that stops reading a Generate stream does not hold engine
resources: the server's write watchdog aborts the engine request and ends the
call with ABORTED. A raw gRPC client over a real socket, a real server process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.cli import build_parser, config_from_args
from harness.engine import (
    FLOOD_SIM_ARGS,
    flood_generate,
    own_channel,
    sim_cli_args,
    wait_load_async,
)
from harness.procs import Proc, ProcessGroup
from tests.faults.faults_common import record

pytestmark = pytest.mark.serial

WATCHDOG_S = 1.0
# Up to 30k tokens of flood_generate's large deltas.
MAX_TOKENS = 30_000


async def _load(stub: pb_grpc.EngineServiceStub) -> pb.GetLoadResponse:
    return await stub.GetLoad(pb.GetLoadRequest(), timeout=5)


async def read_to_the_watchdogs_status(
    call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall,
) -> None:
    """Reading again drains what was buffered, then the watchdog's status: ABORTED,
    a stream write timeout."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async with asyncio.timeout(30):
            while True:
                message = await call.read()
                assert message is not grpc.aio.EOF, "stream ended without an error"
    assert err.value.code() == grpc.StatusCode.ABORTED, err.value
    assert "stream write timeout" in (err.value.details() or "")


def watched_engine(group: ProcessGroup, *args: str) -> tuple[Proc, str]:
    """A sim engine server whose write watchdog fires after WATCHDOG_S."""
    return group.engine_server("engine", "--stream-write-timeout-s", str(WATCHDOG_S), *args)


async def test_stalled_stream_is_aborted_by_the_watchdog(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        engine, address = watched_engine(group, *FLOOD_SIM_ARGS)
        stalled = own_channel(address)
        control = own_channel(address)
        try:
            stub = pb_grpc.EngineServiceStub(stalled)
            ctl = pb_grpc.EngineServiceStub(control)
            call = stub.Generate(flood_generate("stalled-1", MAX_TOKENS))
            # Read a little, then stop reading (the call stays open).
            for _ in range(5):
                message = await call.read()
                assert message.token_ids
            stalled_at = time.monotonic()
            load = await _load(ctl)
            assert load.registered_requests == 1, load

            await wait_load_async(
                ctl,
                lambda load: load.registered_requests == 0 and load.running_requests == 0,
                WATCHDOG_S + 15.0,
                "the watchdog to free the stalled request",
                interval=0.05,
            )
            freed_s = time.monotonic() - stalled_at
            assert engine.alive()
            await read_to_the_watchdogs_status(call)
            record(
                "stalled_client",
                watchdog_s=WATCHDOG_S,
                engine_request_freed_after_client_stopped_reading_s=round(freed_s, 2),
            )
            # The server still serves.
            ok = stub.Generate(
                pb.GenerateRequest(
                    request_id="after-stall",
                    prompt_token_ids=[5, 6, 7],
                    stop=pb.StopConditions(max_tokens=4, ignore_eos=True),
                )
            )
            tokens = [t async for m in ok for t in m.token_ids]
            assert len(tokens) == 4
        finally:
            await stalled.close()
            await control.close()


@pytest.mark.parametrize(
    ("flag", "expected"), [(None, 30.0), ("2.5", 2.5), ("0", None)], ids=["default", "set", "off"]
)
def test_the_stream_write_timeout_defaults_to_30s_and_0_turns_it_off(
    flag: str | None, expected: float | None
) -> None:
    argv = sim_cli_args() + (["--stream-write-timeout-s", flag] if flag is not None else [])
    assert config_from_args(build_parser("sim").parse_args(argv)).stream_write_timeout_s == expected


def test_negative_stream_write_timeout_is_refused() -> None:
    args = build_parser("sim").parse_args([*sim_cli_args(), "--stream-write-timeout-s", "-1"])
    with pytest.raises(SystemExit, match="stream-write-timeout-s"):
        config_from_args(args)


async def test_stalled_rollouts_stream_is_aborted_by_the_watchdog(tmp_path: Path) -> None:
    """Rollouts: answers pile up unread (large routed experts); the watchdog ends the
    call with ABORTED and aborts the rollouts still running on it."""
    with ProcessGroup(tmp_path / "logs") as group:
        engine, address = watched_engine(
            group,
            "--decode-step-ms",
            "2",
            "--eos-rate",
            "0",
            "--routed-experts",
            "4,128,128",
            "--context-length",
            "16384",
            "--num-kv-blocks",
            "5000",
            "--max-num-seqs",
            "64",
        )
        stalled = own_channel(address, ("grpc.max_receive_message_length", 64 << 20))
        control = own_channel(address)
        try:
            ctl = pb_grpc.EngineServiceStub(control)
            call = pb_grpc.EngineServiceStub(stalled).Rollouts()
            # 40 answers of ~520 KB each (1020 positions x 4 layers x top-128; few
            # layers keep the sim's pure-Python expert choice cheap), and two
            # rollouts that would run for many seconds more.
            starts = [
                pb.RolloutStart(
                    tag=i,
                    rollout=pb.RolloutRequest(
                        request_id=f"big-{i}",
                        prompt_token_ids=list(range(10, 30)),
                        max_new_tokens=1000,
                    ),
                )
                for i in range(40)
            ]
            starts += [
                pb.RolloutStart(
                    tag=100 + i,
                    rollout=pb.RolloutRequest(
                        request_id=f"long-{i}",
                        prompt_token_ids=list(range(40, 60)),
                        max_new_tokens=15000,
                    ),
                )
                for i in range(2)
            ]
            await call.write(pb.RolloutsRequest(start=starts))
            started = time.monotonic()
            # Never read. What still runs is aborted once a write waited too long;
            # left alone, the long rollouts would run for 15k decode steps (30 s).
            await wait_load_async(
                ctl, lambda load: load.registered_requests > 0, 10, "the rollouts registered"
            )
            load = await wait_load_async(
                ctl,
                lambda load: load.registered_requests == 0,
                60.0,
                "the watchdog to free the stalled stream's rollouts",
                interval=0.05,
            )
            freed_s = time.monotonic() - started
            assert load.running_requests == 0 and engine.alive()
            assert freed_s < 25.0, f"rollouts of a stalled stream ran on for {freed_s:.1f}s"
            await read_to_the_watchdogs_status(call)
            record(
                "stalled_rollouts_stream",
                watchdog_s=WATCHDOG_S,
                long_rollouts_freed_s=round(freed_s, 2),
            )
            # The server still serves rollouts on a new stream.
            again = pb_grpc.EngineServiceStub(control).Rollouts()
            await again.write(
                pb.RolloutsRequest(
                    start=[
                        pb.RolloutStart(
                            tag=1,
                            rollout=pb.RolloutRequest(
                                request_id="after", prompt_token_ids=[5, 6], max_new_tokens=4
                            ),
                        )
                    ]
                )
            )
            (result,) = (await asyncio.wait_for(again.read(), 10)).results
            assert len(result.response.token_ids) == 4
            again.cancel()
        finally:
            await stalled.close()
            await control.close()
