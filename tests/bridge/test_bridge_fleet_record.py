"""What a bridge publishes in its model card for a trainer's fleet refit
(``bridge.fleet_record``), and that Dynamo is handed it at registration."""

from __future__ import annotations

import pytest

from bridge.admin.system_server import SystemPort
from bridge.client import ClientOptions
from bridge.config import BridgeConfig
from bridge.engine import BridgeEngine
from bridge.fleet_record import admin_url, advertised_host, runtime_data
from rl_client.fleet_discovery import RUNTIME_DATA_KEY
from rl_client.tls import TlsOptions
from tests.bridge.bridge_fakes import FakeServer


def test_the_record_names_the_admin_url_and_the_engine_address() -> None:
    config = BridgeConfig(engine_address="unix:/tmp/e.sock", model_path="/m")
    data = runtime_data(config, SystemPort("127.0.0.1", 9090, 20000), env={})
    assert data == {
        RUNTIME_DATA_KEY: {
            "schema": 1,
            "admin_url": "http://127.0.0.1:9090",
            "engine_address": "unix:/tmp/e.sock",
            "engine_tls": False,
        }
    }
    # No system port: no admin routes to name.
    tls = BridgeConfig(
        engine_address="10.0.0.5:50051", model_path="/m", client=ClientOptions(tls=TlsOptions())
    )
    assert runtime_data(tls, None, env={})[RUNTIME_DATA_KEY] == {
        "schema": 1,
        "admin_url": None,
        "engine_address": "10.0.0.5:50051",
        "engine_tls": True,
    }


@pytest.mark.parametrize("bound", ["0.0.0.0", "", "::"])
def test_a_wildcard_host_is_advertised_as_one_others_reach(bound: str) -> None:
    assert advertised_host(bound, {"BRIDGE_ADVERTISED_HOST": "w0.cluster"}) == "w0.cluster"
    assert advertised_host(bound, {"DYN_TCP_RPC_HOST": "10.1.2.3"}) == "10.1.2.3"
    guessed = advertised_host(bound, {"DYN_TCP_RPC_HOST": "0.0.0.0"})
    assert guessed not in ("", "0.0.0.0", "::")  # this host's outbound address, or loopback
    assert advertised_host("10.9.9.9", {"BRIDGE_ADVERTISED_HOST": "x"}) == "10.9.9.9"
    port = SystemPort(bound, 9090, 20000)
    assert admin_url(port, {"BRIDGE_ADVERTISED_HOST": "fd00::5"}) == "http://[fd00::5]:9090"


async def test_start_hands_dynamo_the_record_in_runtime_data() -> None:
    async with FakeServer() as server:
        engine = BridgeEngine(BridgeConfig(engine_address=server.address, model_path="/m"))
        try:
            config = await engine.start(worker_id=1)
        finally:
            await engine.cleanup()
    assert config.runtime_data is not None
    entry = config.runtime_data[RUNTIME_DATA_KEY]
    assert entry["engine_address"] == server.address and entry["admin_url"] is None
