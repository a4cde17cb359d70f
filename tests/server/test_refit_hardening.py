"""Issue 28, engine side, on a real sim engine-server process over real gRPC: the
folders weight updates may load from (``--weights-allowed-dir``), version labels
that are not printable text (refused on every RPC that sets one, never in
/metrics), and a streamed update whose trainer dies before closing its stream."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness import ROOT
from harness.checkpoints import tiny_weights_dir
from harness.engine import greedy_rollout, tokens_and_logprobs
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.tiny_model import tiny_model_dir

SERVICE = "engine_contract.v1.EngineService"
# Not printable text: a NUL (ends a C string), a newline (forges a log line), a
# bidi override (makes a label read as another).
BAD_LABELS = {"U+0000": "v\x001", "U+000A": "v\n1", "U+202E": "v\u202e1"}


@dataclass
class Server:
    address: str
    stub: pb_grpc.EngineServiceStub
    health: health_pb2_grpc.HealthStub
    metrics_url: str
    allowed: Path  # holds "base" (the served weights) and "seed1"
    outside: Path  # holds "seed1" too, outside the allowed folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("refit-hardening")
    allowed, outside = root / "allowed", root / "outside"
    for folder, name, source in (
        (allowed, "base", tiny_model_dir()),
        (allowed, "seed1", tiny_weights_dir(1)),
        (outside, "seed1", tiny_weights_dir(1)),
    ):
        (folder / name).mkdir(parents=True)
        shutil.copy(source / "model.safetensors", folder / name / "model.safetensors")
    port = free_port()
    with ProcessGroup(root / "logs") as group:
        _, address = group.engine_server(
            "engine",
            "--model",
            str(tiny_model_dir()),
            "--eos-rate",
            "0",
            "--metrics-port",
            str(port),
            "--weights-allowed-dir",
            str(allowed),
        )
        with grpc.insecure_channel(address) as channel:
            yield Server(
                address,
                pb_grpc.EngineServiceStub(channel),
                health_pb2_grpc.HealthStub(channel),
                f"http://127.0.0.1:{port}/metrics",
                allowed,
                outside,
            )


def greedy(stub: pb_grpc.EngineServiceStub) -> tuple[list[int], list[float]]:
    return tokens_and_logprobs(greedy_rollout(stub, [5, 6, 7, 8], 8, timeout=30))


def refused(call: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call(*args, timeout=10)  # type: ignore[operator]
    return error.value


def test_updates_load_only_from_the_allowed_folders(server: Server, tmp_path: Path) -> None:
    stub, allowed = server.stub, server.allowed
    (allowed / "escape").symlink_to(server.outside / "seed1")  # inside, pointing outside
    (tmp_path / "way-in").symlink_to(allowed / "seed1")  # outside, pointing inside
    before = greedy(stub)
    version = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version
    stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
    try:
        for path in (
            allowed / "escape",
            allowed / ".." / "outside" / "seed1",
            server.outside / "seed1",
            Path(f"{allowed}-twin"),  # a name sharing the prefix is not inside
        ):
            error = refused(
                stub.UpdateWeightsFromPath, pb.UpdateWeightsFromPathRequest(path=str(path))
            )
            details = error.details() or ""  # type: ignore[attr-defined]
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, details  # type: ignore[attr-defined]
            assert "--weights-allowed-dir" in details and repr(str(allowed)) in details, details
            assert "the old weights still serve" in details, details
        status = server.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version == (
            version
        )
        # Through a symlink that resolves inside: allowed, and those weights serve.
        stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(path=str(tmp_path / "way-in")), timeout=30
        )
        stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
        assert greedy(stub) != before
        stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
        stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(
                path=str(allowed / "seed1" / ".." / "base"),
                options=pb.WeightUpdateOptions(weight_version=version),
            ),
            timeout=30,
        )
    finally:
        stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
    assert greedy(stub) == before


@pytest.mark.parametrize("code_point", sorted(BAD_LABELS))
def test_labels_that_are_not_printable_are_refused_on_every_rpc(
    server: Server, code_point: str
) -> None:
    stub, label = server.stub, BAD_LABELS[code_point]
    version = stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version
    calls = [
        (stub.UpdateWeightVersion, pb.UpdateWeightVersionRequest(weight_version=label)),
        (
            stub.UpdateWeightsFromPath,
            pb.UpdateWeightsFromPathRequest(
                path=str(server.allowed / "base"),
                options=pb.WeightUpdateOptions(weight_version=label),
            ),
        ),
        (stub.FinishWeightUpdate, pb.FinishWeightUpdateRequest(weight_version=label)),
    ]
    stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
    try:
        for call, request in calls:
            error = refused(call, request)
            details = error.details() or ""  # type: ignore[attr-defined]
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, details  # type: ignore[attr-defined]
            assert f"character {code_point}" in details and "weight_version" in details, details
            assert label not in details
    finally:
        stub.ResumeGeneration(pb.ResumeGenerationRequest(), timeout=10)
    assert stub.GetWeightVersion(pb.GetWeightVersionRequest(), timeout=10).weight_version == version
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read()
    assert b"\x00" not in text and "\u202e".encode() not in text
    assert f'engine_server_weight_version_info{{version="{version}"}}'.encode() in text


# A trainer that streams a whole checkpoint unpaused, then hangs without closing
# its stream (it is killed there); marked (argv[3]): its manifest announced the end
# message (revision 13), which it never sends.
STREAMER = """
import sys, time, grpc
from pathlib import Path
from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import checkpoint_tensors

def stream():
    marked = sys.argv[3] == "marked"
    requests = list(update_requests(
        checkpoint_tensors(Path(sys.argv[2])), allow_unpaused=True, reset_prefix_cache=False,
        end_marker=marked,
    ))
    yield from requests[:-1] if marked else requests
    print("sent", flush=True)
    time.sleep(3600)

stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(sys.argv[1]))
stub.UpdateWeightsFromTensors(stream())
"""


@pytest.mark.parametrize("marked", [False, True], ids=["revision-12", "end-announced"])
def test_a_trainer_killed_after_its_last_chunk_but_before_closing_loads_nothing(
    server: Server, marked: bool
) -> None:
    """gRPC ends the request stream alike for a half-close and for a client's death;
    the server committed such a dead trainer's weights (under the label already
    set) when every byte had arrived. A revision-12 trainer's death is told apart by
    the cancellation that follows it; a stream that announced its end message
    (revision 13) loads nothing without it, however late the cancellation."""
    before = greedy(server.stub)
    state = server.stub.GetLoad(pb.GetLoadRequest(), timeout=10).refit_state
    streamer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STREAMER,
            server.address,
            str(server.allowed / "seed1"),
            "marked" if marked else "plain",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert streamer.stdout is not None
        assert streamer.stdout.readline() == b"sent\n"
        time.sleep(1.0)  # every byte read by the server, which waits for the close
    finally:
        streamer.kill()
        streamer.wait()
    time.sleep(1.0)
    after = server.stub.GetLoad(pb.GetLoadRequest(), timeout=10).refit_state
    assert (after.weight_changes, after.weight_version) == (
        state.weight_changes,
        state.weight_version,
    )
    assert greedy(server.stub) == before
