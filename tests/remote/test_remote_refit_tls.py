"""Trainers reach an mTLS engine server: ``EngineRefitClient`` and
``ContractWeightSyncClient`` take the bridge's TLS options (``rl_client.tls.TlsOptions``)
and run the refit cycle over them; without a client certificate the server
refuses them. No Dynamo: the engine server runs in this process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import InProcessServer, sim_cli_args
from harness.tiny_model import tiny_model_dir
from rl_client.refit import EngineRefitClient
from rl_client.refit_report import RefitError
from rl_client.refit_rpc import RefitRpc
from rl_client.tls import TlsOptions
from rl_client.weight_sync import ContractWeightSyncClient
from tests.remote.pki import Pki


@dataclass
class MtlsEngine:
    address: str
    tls: TlsOptions
    # Trusts the server, has no client certificate.
    no_client_cert: TlsOptions


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MtlsEngine]:
    pki = Pki(tmp_path_factory.mktemp("refit-pki"))
    ca = pki.ca("ca")
    server_cert, server_key = pki.leaf("server", "ca", server_ips=("127.0.0.1",))
    client_cert, client_key = pki.leaf("trainer", "ca")
    server = InProcessServer.from_cli(
        *sim_cli_args(
            "--model",
            str(tiny_model_dir()),
            "--tls-cert",
            str(server_cert),
            "--tls-key",
            str(server_key),
            "--tls-client-ca",
            str(ca),
        )
    ).start()
    try:
        yield MtlsEngine(
            server.address,
            TlsOptions(ca_file=str(ca), cert_file=str(client_cert), key_file=str(client_key)),
            TlsOptions(ca_file=str(ca)),
        )
    finally:
        server.stop()


async def test_engine_refit_client_runs_a_refit_over_mtls(engine: MtlsEngine) -> None:
    weights = tiny_weights_dir(1)
    async with EngineRefitClient([engine.address], tls=engine.tls) as trainer:
        report = await trainer.refit("mtls-1", path=str(weights), mode="wait")
        assert report.ok and report.workers[0].version == "mtls-1"
        assert report.workers[0].resumed
        tensors = checkpoint_tensors(tiny_model_dir())
        report = await trainer.refit("mtls-2", tensors=tensors, mode="keep")
        assert report.ok and report.workers[0].version == "mtls-2"
    rpc = RefitRpc.connect(engine.address, tls=engine.tls, timeout_s=10)
    try:
        answer = await rpc.get_weight_version()
        assert answer.weight_version == "mtls-2" and answer.declared
        assert not (await rpc.is_paused()).paused
    finally:
        await rpc.close()


async def test_without_a_client_certificate_the_refit_is_refused(engine: MtlsEngine) -> None:
    async with EngineRefitClient([engine.address], tls=engine.no_client_cert) as trainer:
        with pytest.raises(RefitError) as failed:
            await trainer.refit("never", path=str(tiny_weights_dir(1)), mode="wait")
    (worker,) = failed.value.report.workers
    assert worker.stage == "pause" and worker.error is not None
    assert worker.error.startswith("UNAVAILABLE"), worker.error
    # Plaintext reaches nothing either.
    async with EngineRefitClient([engine.address]) as plain:
        with pytest.raises(RefitError):
            await plain.refit("never", path=str(tiny_weights_dir(1)), mode="wait")


def shutdown_refused_with(engine: MtlsEngine, tls: TlsOptions, timeout_s: float) -> grpc.StatusCode:
    """The status ShutdownWeightTransferEngine fails with from a
    ContractWeightSyncClient with ``tls`` (closed twice after: idempotent)."""
    client = ContractWeightSyncClient(engine.address, tls=tls, timeout_s=timeout_s)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.shutdown_weight_transfer_engine()
        return refused.value.code()
    finally:
        client.close()
        client.close()


def test_contract_weight_sync_client_reaches_an_mtls_engine(engine: MtlsEngine) -> None:
    """The sim engine has no weight-transfer engine: its refusal (not a handshake
    failure) shows the call got through."""
    assert shutdown_refused_with(engine, engine.tls, 10) == grpc.StatusCode.FAILED_PRECONDITION
    # Without a client certificate the handshake fails.
    assert shutdown_refused_with(engine, engine.no_client_cert, 5) == grpc.StatusCode.UNAVAILABLE
