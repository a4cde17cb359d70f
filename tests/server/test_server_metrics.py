"""The engine server's /metrics after known traffic: counts checked exactly.

Real server processes (``python -m engine_server --metrics-port``), real gRPC,
real HTTP scrapes; the drain, which ends the process and its endpoint, is
checked on an in-process server's registry before and after.
"""

from __future__ import annotations

import http.client
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY, generate_latest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.cli import parse_args
from harness.engine import (
    FLOOD_SIM_ARGS,
    InProcessServer,
    flood_generate,
    own_channel,
    sim_cli_args,
    wait_load_async,
)
from harness.metrics import Samples, scrape
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.waits import wait_until

pytestmark = pytest.mark.serial

CAUSES = ("client_cancel", "abort_rpc", "drain", "watchdog", "pause")


def metrics_server(group: ProcessGroup, *args: str) -> tuple[str, str]:
    """A sim engine server with metrics on a free loopback port: (address, metrics URL)."""
    port = free_port()
    _, address = group.engine_server("engine", "--metrics-port", str(port), *args)
    return address, f"http://127.0.0.1:{port}/metrics"


def rollout(request_id: str, prompt: int, max_new_tokens: int = 8) -> pb.RolloutRequest:
    return pb.RolloutRequest(
        request_id=request_id,
        prompt_token_ids=list(range(5, 5 + prompt)),
        max_new_tokens=max_new_tokens,
    )


def long_generate(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7],
        stop=pb.StopConditions(max_tokens=4000, ignore_eos=True),
    )


async def read_to_end(call: grpc.aio.UnaryStreamCall) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


def aborts(samples: Samples) -> dict[str, float]:
    return {cause: samples.value("engine_server_aborts_total", cause=cause) for cause in CAUSES}


async def test_rollouts_rpcs_tokens_kv_and_state(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        address, url = metrics_server(group, "--zero-delay")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            kv = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
            await kv.initial_metadata()
            # 5 unary rollouts, 3 on one Rollouts stream.
            answers = [await stub.Rollout(rollout(f"u{i}", 3 + i)) for i in range(5)]
            stream = stub.Rollouts()
            await stream.write(
                pb.RolloutsRequest(
                    start=[pb.RolloutStart(tag=t, rollout=rollout(f"s{t}", 10)) for t in range(3)]
                )
            )
            await stream.done_writing()
            async for message in stream:
                answers += [r.response for r in message.results]
            assert len(answers) == 8 and all(a.token_ids for a in answers)

            samples = scrape(url)
            # Every live batch the hub numbered reaches the subscriber, in order.
            batches = int(samples.value("engine_server_kv_batches_total"))
            seen_batches, seen_events = 0, 0
            while seen_batches < batches:
                message = await kv.read()
                for batch in message.batches or [message.batch]:
                    if not batch.HasField("snapshot"):
                        seen_batches += 1
                        seen_events += len(batch.events)
            kv.cancel()

        assert samples.value("engine_server_requests_total", kind="rollout") == 8
        assert samples.value(
            "engine_server_requests_total", kind="rollout", finish_reason="length"
        ) == sum(a.finish_reason == pb.FINISH_REASON_LENGTH for a in answers)
        assert samples.value("engine_server_request_duration_seconds_count", kind="rollout") == 8
        assert samples.value("engine_server_request_queue_seconds_count", kind="rollout") == 8
        assert samples.value("engine_server_request_engine_seconds_count", kind="rollout") == 8
        assert samples.value("engine_server_requests_total", kind="generate") == 0
        assert samples.value("engine_server_prompt_tokens_total", kind="rollout") == sum(
            a.usage.prompt_tokens for a in answers
        )
        assert samples.value("engine_server_generation_tokens_total", kind="rollout") == sum(
            len(a.token_ids) for a in answers
        )
        assert samples.value("engine_server_rpc_calls_total", method="Rollout", code="OK") == 5
        assert samples.value("engine_server_rpc_calls_total", method="Rollouts", code="OK") == 1
        assert samples.value("engine_server_rpc_calls_total", method="GetServerInfo") == 1
        # 3 answers over the Rollouts stream, in however many messages.
        assert samples.value("engine_server_stream_items_per_message_sum", stream="rollouts") == 3
        assert samples.value("engine_server_kv_snapshots_total") == 1
        assert samples.value("engine_server_kv_subscribers") == 1
        assert samples.value("engine_server_kv_events_total") == seen_events > 0
        assert samples.value("engine_server_kv_replay_evictions_total") == 0
        assert samples.value("engine_server_requests_registered") == 0
        assert samples.value("engine_server_paused") == 0
        assert aborts(samples) == dict.fromkeys(CAUSES, 0)
        [server] = samples.labels("engine_server_info")
        assert server["instance_id"] == info.instance_id and server["backend"] == "sim"
        [version] = samples.labels("engine_server_weight_version_info")
        assert version["version"] == "default"
        assert "process_cpu_seconds_total" in samples.names()  # the default registry's
        # No request id ever becomes a label.
        assert "u0" not in samples.text and "s1" not in samples.text

        # A closed subscription is no longer counted.
        wait_until(
            lambda: scrape(url).value("engine_server_kv_subscribers") == 0, 10, "unsubscribed"
        )


async def test_aborts_are_counted_by_their_cause(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        address, url = metrics_server(group, "--decode-step-ms", "5", "--eos-rate", "0")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)

            # A cancelled unary Rollout.
            call = stub.Rollout(rollout("cancel-unary", 3, max_new_tokens=4000))
            await wait_load_async(stub, lambda load: load.running_requests == 1)
            call.cancel()
            await wait_load_async(stub, lambda load: load.registered_requests == 0)

            # One rollout of two cancelled by tag on a Rollouts stream.
            stream = stub.Rollouts()
            await stream.write(
                pb.RolloutsRequest(
                    start=[
                        pb.RolloutStart(tag=1, rollout=rollout("tagged", 3, 4000)),
                        pb.RolloutStart(tag=2, rollout=rollout("short", 3, 4)),
                    ]
                )
            )
            await wait_load_async(stub, lambda load: load.registered_requests == 1)
            await stream.write(pb.RolloutsRequest(cancel=[1]))
            await stream.done_writing()
            results = [r async for m in stream for r in m.results]
            assert sorted(r.error.code for r in results) == [0, grpc.StatusCode.CANCELLED.value[0]]

            # An Abort RPC.
            generating = stub.Generate(long_generate("aborted"))
            await generating.read()
            answer = await stub.Abort(pb.AbortRequest(request_id="aborted"))
            assert answer.outcome == pb.ABORT_OUTCOME_ABORTED
            await read_to_end(generating)

            # PauseGeneration(ABORT) with one request running; then resume.
            paused = stub.Generate(long_generate("paused"))
            await paused.read()
            await stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_to_end(paused)
            assert err.value.code() == grpc.StatusCode.ABORTED
            during = scrape(url)
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())

        samples = scrape(url)
        assert during.value("engine_server_paused") == 1
        assert samples.value("engine_server_paused") == 0
        assert aborts(samples) == {
            "client_cancel": 2,
            "abort_rpc": 1,
            "drain": 0,
            "watchdog": 0,
            "pause": 1,
        }
        assert (
            samples.value("engine_server_rpc_calls_total", method="Rollout", code="CANCELLED") == 1
        )
        assert (
            samples.value("engine_server_rpc_calls_total", method="Generate", code="ABORTED") == 1
        )
        assert samples.value("engine_server_rpc_calls_total", method="Abort", code="OK") == 1


async def test_watchdog_abort_is_counted(tmp_path: Path) -> None:
    """A client that stops reading a Generate stream (as in test_faults_stalled_client)."""
    with ProcessGroup(tmp_path / "logs") as group:
        address, url = metrics_server(group, "--stream-write-timeout-s", "1", *FLOOD_SIM_ARGS)
        async with own_channel(address) as stalled, own_channel(address) as control:
            call = pb_grpc.EngineServiceStub(stalled).Generate(flood_generate("stalled", 30_000))
            await call.read()  # then read no more
            ctl = pb_grpc.EngineServiceStub(control)
            await wait_load_async(ctl, lambda load: load.registered_requests == 0, 20)
            # The call's status waits behind what the client never read.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_to_end(call)
            assert err.value.code() == grpc.StatusCode.ABORTED
            wait_until(
                lambda: scrape(url).value("engine_server_rpc_calls_total", method="Generate") == 1,
                10,
                "the stalled call ended",
            )
            samples = scrape(url)
        assert aborts(samples) == {**dict.fromkeys(CAUSES, 0), "watchdog": 1}
        assert (
            samples.value("engine_server_rpc_calls_total", method="Generate", code="ABORTED") == 1
        )


def test_drain_aborts_are_counted() -> None:
    """SIGTERM's drain ends the process with its endpoint, so the drain is read from
    an in-process server's registry (the text the endpoint serves), before and after."""

    def drained() -> float:
        return Samples.parse(generate_latest(REGISTRY).decode()).value(
            "engine_server_aborts_total", cause="drain"
        )

    server = InProcessServer.from_cli(
        *sim_cli_args("--decode-step-ms", "5", "--eos-rate", "0", "--grace-period-s", "0.2")
    ).start()
    before = drained()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            calls = [stub.Generate(long_generate(f"drained-{i}")) for i in range(2)]
            for call in calls:
                next(call)
            started = time.monotonic()
            stopping = server.submit(server.handle.stop(0.2))
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            stopping.result(20)
            assert time.monotonic() - started < 20
    finally:
        server.stop()
    assert drained() - before == 2


def test_metrics_port_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("70000", "-1", "http"):
        with pytest.raises(SystemExit):
            parse_args(["--backend", "sim", "--metrics-port", bad])
        assert "--metrics-port" in capsys.readouterr().err
    assert parse_args(["--backend", "sim", "--metrics-port", "0"]).metrics_port == 0


def test_endpoint_answers_only_get_metrics(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        _, url = metrics_server(group, "--zero-delay")
        host, port = url.removeprefix("http://").removesuffix("/metrics").split(":")
        for method, path, status in (("POST", "/metrics", 405), ("GET", "/other", 404)):
            connection = http.client.HTTPConnection(host, int(port), timeout=5)
            connection.request(method, path)
            assert connection.getresponse().status == status
            connection.close()
        assert "engine_server_rpc_calls_total" in scrape(url).text
