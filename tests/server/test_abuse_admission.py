"""Issue 12, items 1 and 7: bounded admission.

One ``Rollouts`` message of 100,000 starts, sent to a real server process: every
start past ``max_starts_per_message`` fails alone with RESOURCE_EXHAUSTED naming
the limit, the stream goes on, the server's memory stays bounded and GetLoad
(asked by another process) answers within 100 ms throughout. A unary call over
an admission limit is refused with the limit in its trailing metadata
(retryable), a message over the size limit without it (not retryable).
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_contract.retry import LIMIT_TRAILER, is_retryable
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import InProcessServer, idle, long_sim_args, sim_cli_args, wait_load
from harness.procs import ProcessGroup
from tests.faults.faults_common import record
from tests.server.abuse_common import GetLoadProbe, PeakRss, server_cost, server_with_limits

pytestmark = pytest.mark.serial

FLOOD = 100_000
ROLLOUTS = "/engine_contract.v1.EngineService/Rollouts"
MB = 1e6


def one_token_start(tag: int, prefix: str = "flood") -> pb.RolloutStart:
    return pb.RolloutStart(
        tag=tag,
        rollout=pb.RolloutRequest(
            request_id=f"{prefix}-{tag}", prompt_token_ids=[5], max_new_tokens=1
        ),
    )


def limit_of(err: grpc.RpcError) -> str:
    """The admission limit a failed call's trailing metadata names ("" if none)."""
    return dict(err.trailing_metadata() or ()).get(LIMIT_TRAILER, "")


@pytest.mark.slow
def test_100k_starts_in_one_message_are_each_answered_once_past_the_limit_refused(
    tmp_path: Path,
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        engine, address = group.engine_server("engine", "--zero-delay")
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        with channel:
            stub = pb_grpc.EngineServiceStub(channel)
            limits = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).limits
            most = limits.max_starts_per_message
            assert 0 < most < FLOOD, limits
            flood = pb.RolloutsRequest(start=[one_token_start(t) for t in range(FLOOD)])
            flood_bytes = flood.SerializeToString()
            del flood
            second = pb.RolloutsRequest(
                start=[one_token_start(FLOOD + t, "second") for t in range(8)]
            ).SerializeToString()

            # Raw answers while measuring, parsed afterwards: on a small machine this
            # process's own decoding would otherwise compete with the server and
            # the probe for the CPU.
            call = channel.stream_stream(
                ROLLOUTS,
                request_serializer=lambda raw: raw,
                response_deserializer=lambda raw: raw,
            )
            with (
                GetLoadProbe(address, tmp_path / "probe.json") as probe,
                PeakRss(engine.pid) as rss,
            ):
                started = time.monotonic()
                # The flood, then (read by the server once the flood is handled) a
                # second message on the same stream; then half-close: the call ends
                # once every start is answered.
                raw_answers = list(call(iter([flood_bytes, second]), timeout=120))
                flood_s = time.monotonic() - started

            answers: Counter[int] = Counter()
            refused: list[int] = []
            failed: list[pb.RolloutResult] = []
            for raw in raw_answers:
                for result in pb.RolloutsResponse.FromString(raw).results:
                    answers[result.tag] += 1
                    error = result.error
                    if result.HasField("error") and error.limit == "max_starts_per_message":
                        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], result
                        refused.append(result.tag)
                    elif result.HasField("error"):
                        failed.append(result)
            assert not failed, failed[:3]
            assert len(answers) == FLOOD + 8 and set(answers.values()) == {1}, [
                (tag, n) for tag, n in answers.items() if n != 1
            ][:10]
            assert sorted(refused) == list(range(most, FLOOD)), (len(refused), refused[:5])
            wait_load(address, idle, 10, "idle after the flood")
            growth = rss.growth_mb
            record(
                "abuse_100k_starts",
                message_bytes=len(flood_bytes),
                max_starts_per_message=most,
                refused=len(refused),
                all_answered_s=round(flood_s, 3),
                **server_cost(rss, probe),
            )
            assert growth < 150, f"server RSS grew {growth:.0f} MB ({rss.base / MB:.0f} MB before)"
            assert not probe.result["errors"], probe.summary(since=started)
            assert probe.worst_ms < 100, probe.summary(since=started)
            engine.check_alive()


# -- refusals of single calls ----------------------------------------------------------


@pytest.fixture
def two_in_flight() -> Iterator[InProcessServer]:
    """A sim server that admits 2 requests at once; EOS never likeliest, 20 ms a step."""
    server = server_with_limits(*long_sim_args(decode_step_ms=20), max_requests_in_flight=2)
    yield server
    server.stop()


def long_rollout(request_id: str) -> pb.RolloutRequest:
    return pb.RolloutRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], max_new_tokens=2000)


def test_capacity_refusal_names_its_limit_in_the_trailer(two_in_flight: InProcessServer) -> None:
    address = two_in_flight.address
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.limits.max_requests_in_flight == 2, info.limits
        running = [stub.Rollout.future(long_rollout(f"long-{i}"), timeout=60) for i in range(2)]
        try:
            wait_load(address, lambda load: load.registered_requests == 2, 10)

            with pytest.raises(grpc.RpcError) as third:
                stub.Rollout(long_rollout("third"), timeout=10)
            err = third.value
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert limit_of(err) == "max_requests_in_flight", err.trailing_metadata()
            assert "max_requests_in_flight" in (err.details() or "")
            assert is_retryable(err.code(), limit_of(err))

            # Generate and a Rollouts stream count against the same limit.
            with pytest.raises(grpc.RpcError) as gen:
                next(
                    iter(
                        stub.Generate(
                            pb.GenerateRequest(
                                request_id="gen", prompt_token_ids=[5, 6], stop={"max_tokens": 4}
                            ),
                            timeout=10,
                        )
                    )
                )
            assert gen.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert limit_of(gen.value) == "max_requests_in_flight"
            stream = stub.Rollouts(
                iter(
                    [pb.RolloutsRequest(start=[pb.RolloutStart(tag=7, rollout=long_rollout("s"))])]
                ),
                timeout=10,
            )
            (result,) = [r for message in stream for r in message.results]
            assert result.tag == 7 and result.error.limit == "max_requests_in_flight", result
            assert result.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        finally:
            for call in running:
                call.cancel()
        wait_load(address, idle, 10, "idle once the long rollouts are cancelled")
        # Room again: the same request is admitted now.
        served = stub.Rollout(
            pb.RolloutRequest(request_id="after", prompt_token_ids=[5], max_new_tokens=2),
            timeout=30,
        )
        assert len(served.token_ids) == 2


def test_message_over_the_size_limit_is_refused_without_a_limit_trailer() -> None:
    server = InProcessServer.from_cli(*sim_cli_args("--max-message-bytes", "65536")).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            big = pb.RolloutRequest(
                request_id="big", prompt_token_ids=[1000] * 50_000, max_new_tokens=1
            )
            assert big.ByteSize() > 65536
            with pytest.raises(grpc.RpcError) as refused:
                stub.Rollout(big, timeout=10)
            err = refused.value
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert limit_of(err) == "", err.trailing_metadata()
            assert not is_retryable(err.code(), limit_of(err))
            assert idle(stub.GetLoad(pb.GetLoadRequest(), timeout=5))
    finally:
        server.stop()


def test_stream_refuses_rollouts_past_max_rollouts_per_stream() -> None:
    server = server_with_limits(*long_sim_args(decode_step_ms=20), max_rollouts_per_stream=2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            outbox: queue.Queue[pb.RolloutsRequest | None] = queue.Queue()

            def requests() -> Iterator[pb.RolloutsRequest]:
                while (message := outbox.get()) is not None:
                    yield message

            call = stub.Rollouts(requests(), timeout=60)
            responses = iter(call)
            starts = [
                pb.RolloutStart(tag=t, rollout=long_rollout(f"per-stream-{t}")) for t in range(3)
            ]
            outbox.put(pb.RolloutsRequest(start=starts))
            (result,) = next(responses).results
            assert result.tag == 2, result
            assert result.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], result
            assert result.error.limit == "max_rollouts_per_stream", result
            assert is_retryable(grpc.StatusCode.RESOURCE_EXHAUSTED, result.error.limit)
            # Other calls are not held to this stream's count.
            other = stub.Rollout(
                pb.RolloutRequest(request_id="other", prompt_token_ids=[5], max_new_tokens=2),
                timeout=30,
            )
            assert len(other.token_ids) == 2
            outbox.put(pb.RolloutsRequest(cancel=[0, 1]))
            cancelled: list[pb.RolloutResult] = []
            while len(cancelled) < 2:
                cancelled += next(responses).results
            assert sorted(r.tag for r in cancelled) == [0, 1], cancelled
            assert {r.error.code for r in cancelled} == {grpc.StatusCode.CANCELLED.value[0]}
            outbox.put(None)
            assert next(responses, None) is None
        wait_load(server.address, idle, 10)
    finally:
        server.stop()


def test_waiting_requests_over_the_limit_are_refused() -> None:
    """max_waiting_requests: one runs (max-num-seqs 1), one waits, the next is refused."""
    server = server_with_limits(
        *long_sim_args(decode_step_ms=20), "--max-num-seqs", "1", max_waiting_requests=1
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            # One at a time: two sent together can both find the engine's queue
            # holding the first (not yet scheduled), and the second is rightly refused.
            running = [stub.Rollout.future(long_rollout("w-0"), timeout=60)]
            try:
                wait_load(server.address, lambda load: load.running_requests == 1, 10)
                running.append(stub.Rollout.future(long_rollout("w-1"), timeout=60))
                wait_load(
                    server.address,
                    lambda load: load.running_requests == 1 and load.waiting_requests == 1,
                    10,
                )
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Rollout(long_rollout("w-third"), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert limit_of(refused.value) == "max_waiting_requests"
            finally:
                for call in running:
                    call.cancel()
        wait_load(server.address, idle, 10)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "limit",
    [
        "max_requests_in_flight",
        "max_rollouts_per_stream",
        "max_starts_per_message",
        "max_waiting_requests",
        "max_kv_subscribers",
    ],
)
def test_admission_limits_are_command_line_flags(limit: str) -> None:
    """A user configures each admission limit on the command line (as
    --max-message-bytes), and the server announces what it enforces."""
    flag = "--" + limit.replace("_", "-")
    try:
        server = InProcessServer.from_cli(*sim_cli_args(flag, "3")).start()
    except SystemExit as e:
        pytest.fail(f"python -m engine_server has no {flag} flag ({e})")
    try:
        with grpc.insecure_channel(server.address) as channel:
            info = pb_grpc.EngineServiceStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10
            )
        assert getattr(info.limits, limit) == 3, info.limits
    finally:
        server.stop()
