"""Engine-server lifecycle: health transitions, drain, SIGTERM, listening options."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, health_status, sim_cli_args
from harness.procs import ProcessGroup
from harness.waits import wait_until

pytestmark = pytest.mark.serial

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def inproc(*extra: str) -> InProcessServer:
    return InProcessServer.from_cli(*sim_cli_args(*extra))


def long_request(request_id: str, max_tokens: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7])
    request.stop.max_tokens = max_tokens
    request.stop.ignore_eos = True
    return request


def test_not_serving_until_the_engine_is_ready() -> None:
    server = inproc("--startup-delay-s", "1.5").start(wait_ready=False)
    try:
        address = server.address
        assert health_status(address) == NOT_SERVING
        assert health_status(address, "") == NOT_SERVING
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            for call, request in (
                (stub.GetServerInfo, pb.GetServerInfoRequest()),
                (stub.Rollout, pb.RolloutRequest(request_id="early", prompt_token_ids=[5])),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "not ready" in err.value.details()
        server.run(server.handle.wait_ready())
        assert health_status(address) == SERVING
    finally:
        server.stop()


def test_drain_finishes_short_requests_aborts_long_ones_and_refuses_new() -> None:
    server = inproc("--decode-step-ms", "5", "--grace-period-s", "0.6").start()
    address = server.address

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            short = asyncio.ensure_future(
                stub.Rollout(
                    pb.RolloutRequest(
                        request_id="short", prompt_token_ids=[5, 6], max_new_tokens=20
                    )
                )
            )
            long = stub.Generate(long_request("long", 4000))
            await long.read()
            stopping = asyncio.ensure_future(
                asyncio.wrap_future(server.submit(server.handle.stop()))
            )
            await asyncio.to_thread(
                wait_until, lambda: health_status(address, "") == NOT_SERVING, 5, "draining"
            )
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert status.status == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Rollout(pb.RolloutRequest(request_id="late", prompt_token_ids=[5]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in err.value.details()
            answer = await short
            assert answer.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
            # Past the grace period: a retryable error, not a partial result.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await long.read() != grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shut down before the request finished" in err.value.details()
            await stopping

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 5
    assert server.handle.backend.load().running == 0
    server.stop()


EVENT_LOOPS = pytest.mark.parametrize("loop", ["uvloop", "asyncio"])


@EVENT_LOOPS
def test_sigterm_drains_and_exits_zero(tmp_path: Path, loop: str) -> None:
    with ProcessGroup(tmp_path) as group:
        proc, address = group.engine_server(
            "server", "--decode-step-ms", "5", "--grace-period-s", "1", "--event-loop", loop
        )
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            stream = stub.Generate(long_request("long", 100_000 // 50))
            next(stream)
            proc.signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        started = time.monotonic()
        assert proc.stop(timeout=20) == 0, proc.log_tail()
        assert time.monotonic() - started < 10
        assert "[shutdown] stopped" in proc.log_tail()


@EVENT_LOOPS
def test_sigterm_repeated_until_it_exits_still_exits_zero(tmp_path: Path, loop: str) -> None:
    """A supervisor that repeats SIGTERM (as a test's stop() does) up to the very end:
    the exit is still clean, never death by the signal in the interpreter's teardown."""
    with ProcessGroup(tmp_path) as group:
        proc, _ = group.engine_server("server", "--grace-period-s", "1", "--event-loop", loop)
        assert proc.signal_until_exit(signal.SIGTERM, 20) == 0, proc.log_tail()
        assert "[shutdown] stopped" in proc.log_tail()


def test_the_server_serves_on_a_unix_socket(tmp_path: Path) -> None:
    server = inproc("--listen", f"unix:{tmp_path}/engine.sock").start()
    try:
        assert server.address == f"unix:{tmp_path}/engine.sock"
        with grpc.insecure_channel(server.address) as channel:
            answer = pb_grpc.EngineServiceStub(channel).Rollout(
                pb.RolloutRequest(request_id="u", prompt_token_ids=[5, 6], max_new_tokens=3),
                timeout=10,
            )
        assert 1 <= len(answer.token_ids) <= 3
    finally:
        server.stop()


def test_non_loopback_listen_is_refused_unless_allowed(tmp_path: Path) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "engine_server", "--backend", "sim", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "non-loopback" in refused.stderr and "--allow-remote" in refused.stderr
    with ProcessGroup(tmp_path) as group:
        proc, address = group.engine_server("server", "--allow-remote", listen="0.0.0.0:0")
        port = address.rsplit(":", 1)[1]
        assert health_status(f"127.0.0.1:{port}", "") == SERVING
        assert proc.stop(timeout=30) == 0


def test_port_in_use_is_a_clear_error() -> None:
    server = inproc().start()
    try:
        taken = subprocess.run(
            [sys.executable, "-m", "engine_server", "--listen", server.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 2 and "cannot listen" in taken.stderr
    finally:
        server.stop()


def test_a_client_older_than_the_window_is_refused() -> None:
    oldest = engine_contract.MINIMUM_CLIENT_REVISION
    server = inproc().start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetServerInfo(pb.GetServerInfoRequest(client_revision=oldest - 1), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"client_revision {oldest - 1} is older than this server accepts" in (
                err.value.details() or ""
            )
            info = stub.GetServerInfo(pb.GetServerInfoRequest(client_revision=oldest), timeout=5)
            assert info.minimum_client_revision == oldest
            # A client that states no revision (0) is served.
            assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).instance_id
    finally:
        server.stop()
