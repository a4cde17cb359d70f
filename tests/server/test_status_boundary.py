"""The status boundary (engine_server/status.py): an exception nobody anticipated is
logged with its traceback and answered INTERNAL with a bounded message, never the
UNKNOWN gRPC sends for an escaped exception, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server import cli
from engine_server.backends.base import EngineLoad
from engine_server.backends.sim.backend import SimBackend
from harness.engine import InProcessServer, sim_cli_args


class FailingSim(SimBackend):
    """A sim whose load and prefix-cache reset fail as a broken engine's would."""

    fail = True

    def load(self) -> EngineLoad:
        if self.fail:
            raise RuntimeError("engine state lost " + "x" * 5000)
        return super().load()

    async def reset_prefix_cache(self, *, running: bool = False) -> bool:
        raise KeyError("block 42")


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    args = cli.parse_args(sim_cli_args("--zero-delay"))
    _, config = cli.backend_and_config(args)
    server = InProcessServer(FailingSim.from_cli_args(args), config).start()
    yield server
    server.stop()


def test_an_unexpected_failure_is_internal_and_bounded(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        for call, method, text in (
            (lambda: stub.GetLoad(pb.GetLoadRequest(), timeout=10), "GetLoad", "engine state"),
            (
                lambda: stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=10),
                "ResetPrefixCache",
                "block 42",
            ),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INTERNAL, e.value
            details = e.value.details()
            assert details.startswith(f"internal error in {method}: ") and text in details
            assert len(details) < 600, len(details)
        assert "GetLoad failed unexpectedly" in caplog.text
        assert "Traceback" in caplog.text
        # Still serving: a rollout is answered, and GetLoad once the engine recovers.
        answer = stub.Rollout(
            pb.RolloutRequest(request_id="after", prompt_token_ids=[5, 6], max_new_tokens=3),
            timeout=10,
        )
        assert len(answer.token_ids) == 3
        FailingSim.fail = False
        try:
            assert stub.GetLoad(pb.GetLoadRequest(), timeout=10).registered_requests == 0
        finally:
            FailingSim.fail = True
