"""The fleet's workers read from Dynamo's discovery records (``rl_client.fleet_discovery``):
the file store's files and etcd's keys, in the shapes Dynamo 1.6.1 writes them
(taken from a running bridge), only instances registered now, and the refit
clients built from them."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rl_client.fleet_discovery import (
    RUNTIME_DATA_KEY,
    EtcdFleetDiscovery,
    FileFleetDiscovery,
    FleetWorker,
    discover_workers,
    fleet_discovery,
    worker_runtime_data,
)
from rl_client.refit import EngineRefitClient, RefitClient
from rl_client.tls import TlsOptions

NS = "nsfleet"


def instance(ns: str, iid: int, endpoint: str = "generate") -> dict[str, Any]:
    """An instance record as Dynamo 1.6.1 writes it."""
    return {
        "type": "Endpoint",
        "component": "backend",
        "endpoint": endpoint,
        "namespace": ns,
        "instance_id": iid,
        "transport": {"tcp": f"127.0.0.1:42257/{iid:x}/{ns}/backend/{endpoint}"},
        "device_type": "cuda",
        "request_plane_codec": "msgpack",
    }


def card(
    ns: str, iid: int, model: str = "policy", entry: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A model card as Dynamo 1.6.1 writes it (trimmed), the bridge's entry in it."""
    if entry is None:
        entry = worker_runtime_data(
            admin_url=f"http://127.0.0.1:{9000 + iid % 1000}",
            engine_address=f"unix:/tmp/engine-{iid:x}.sock",
            engine_tls=False,
        )
    runtime_data = {RUNTIME_DATA_KEY: entry} if entry else {}
    return {
        "type": "Model",
        "namespace": ns,
        "component": "backend",
        "endpoint": "generate",
        "instance_id": iid,
        "card_json": {
            "display_name": model,
            "slug": model,
            "context_length": 4096,
            "runtime_config": {
                "context_length": 4096,
                "data_parallel_size": 1,
                "runtime_data": runtime_data,
            },
        },
    }


def file_name(ns: str, iid: int, endpoint: str = "generate") -> str:
    # Dynamo percent-encodes the key (its "_" too, unlike urllib).
    return urllib.parse.quote(f"{ns}/backend/{endpoint}/{iid:x}", safe="").replace("_", "%5F")


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, bucket: str, name: str, record: dict[str, Any]) -> Path:
        folder = self.root / "v1" / bucket
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(json.dumps(record))
        return path

    def worker(self, ns: str, iid: int, **kwargs: Any) -> tuple[Path, Path]:
        return (
            self.write("mdc", file_name(ns, iid), card(ns, iid, **kwargs)),
            self.write("instances", file_name(ns, iid), instance(ns, iid)),
        )


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "kv")


def test_the_file_store_lists_each_live_worker_with_its_urls(store: FileStore) -> None:
    store.worker(NS, 0xB2)
    store.worker(NS, 0xA1, model="other")
    workers = FileFleetDiscovery(store.root, NS).workers()
    assert workers == [
        FleetWorker(
            NS, "backend", "generate", 0xA1, "other", "http://127.0.0.1:9161",
            "unix:/tmp/engine-a1.sock", False,
        ),
        FleetWorker(
            NS, "backend", "generate", 0xB2, "policy", "http://127.0.0.1:9178",
            "unix:/tmp/engine-b2.sock", False,
        ),
    ]  # fmt: skip
    only = discover_workers(NS, model="policy", discovery=FileFleetDiscovery(store.root, NS))
    assert [w.instance_id for w in only] == [0xB2]


def test_a_worker_out_of_the_pool_or_expired_is_not_listed(store: FileStore) -> None:
    store.worker(NS, 1)
    _, left = store.worker(NS, 2)
    _, stale = store.worker(NS, 3)
    left.unlink()  # left the router's pool: its card stays, its instance goes
    old = time.time() - 11
    os.utime(stale, (old, old))  # died without a word: no longer renewed
    assert [w.instance_id for w in FileFleetDiscovery(store.root, NS).workers()] == [1]
    # A longer TTL keeps the stale one.
    longer = FileFleetDiscovery(store.root, NS, ttl_s=60)
    assert [w.instance_id for w in longer.workers()] == [1, 3]


def test_only_this_namespace_and_rl_workers_are_listed(store: FileStore) -> None:
    store.worker(NS, 1)
    store.worker(NS + "x", 2)  # a namespace that starts with ours
    store.worker("other", 3)
    store.worker(NS, 4, entry={})  # not a bridge (dynamo.vllm, say): no RL entry
    store.worker(NS, 5, entry={"schema": 99, "admin_url": "http://x"})  # a newer writer
    # Another endpoint of a worker (its KV query source): no card of its own.
    store.write("instances", file_name(NS, 6, "worker_kv_query_source_1"), instance(NS, 6))
    store.write("mdc", ".tmp_" + file_name(NS, 7), card(NS, 7))  # half-written
    store.write("instances", file_name(NS, 7), instance(NS, 7))
    (store.root / "v1" / "mdc" / file_name(NS, 8)).write_text("{not json")
    store.write("instances", file_name(NS, 8), instance(NS, 8))
    assert [w.instance_id for w in FileFleetDiscovery(store.root, NS).workers()] == [1]
    assert FileFleetDiscovery(store.root, "absent").workers() == []
    assert FileFleetDiscovery(store.root / "nowhere", NS).workers() == []


def test_names_with_a_slash_are_refused(store: FileStore) -> None:
    with pytest.raises(ValueError, match="namespace"):
        FileFleetDiscovery(store.root, "a/b")
    with pytest.raises(ValueError, match="component"):
        EtcdFleetDiscovery(["http://127.0.0.1:1"], NS, "")


def test_the_environment_picks_the_store(tmp_path: Path) -> None:
    files = fleet_discovery(NS, env={"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": "/kv"})
    assert isinstance(files, FileFleetDiscovery) and files.root == Path("/kv")
    etcd = fleet_discovery(NS, env={"ETCD_ENDPOINTS": "http://a:2379,http://b:2379"})
    assert isinstance(etcd, EtcdFleetDiscovery)
    assert etcd.endpoints == ["http://a:2379", "http://b:2379"]
    with pytest.raises(ValueError, match="etcd or Dynamo's file store"):
        fleet_discovery(NS, env={"DYN_DISCOVERY_BACKEND": "kubernetes"})


class FakeEtcd:
    """etcd's v3 JSON gateway, ``kv/txn`` with range requests only."""

    def __init__(self) -> None:
        self.kvs: dict[bytes, bytes] = {}
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests.append(body)
                assert self.path == "/v3/kv/txn", self.path
                responses = []
                for op in body["success"]:
                    rng = op["request_range"]
                    start = base64.b64decode(rng["key"])
                    end = base64.b64decode(rng["range_end"])
                    kvs = [
                        {"key": base64.b64encode(k).decode(), "value": base64.b64encode(v).decode()}
                        for k, v in sorted(fake.kvs.items())
                        if start <= k < end
                    ]
                    responses.append({"response_range": {"kvs": kvs, "count": str(len(kvs))}})
                raw = json.dumps({"header": {}, "succeeded": True, "responses": responses})
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(raw.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(self, key: str, record: dict[str, Any]) -> None:
        self.kvs[key.encode()] = json.dumps(record).encode()


@pytest.fixture
def etcd() -> Iterator[FakeEtcd]:
    fake = FakeEtcd()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_etcd_lists_the_workers_whose_instance_key_is_there(etcd: FakeEtcd) -> None:
    for iid in (0x11, 0x22, 0x33):
        etcd.put(f"v1/mdc/{NS}/backend/generate/{iid:x}", card(NS, iid))
    etcd.put(f"v1/instances/{NS}/backend/generate/{0x11:x}", instance(NS, 0x11))
    etcd.put(f"v1/instances/{NS}/backend/generate/{0x33:x}", instance(NS, 0x33))
    etcd.put(f"v1/instances/{NS}/backend/worker_kv_query_source_1/{0x22:x}", instance(NS, 0x22))
    etcd.put(f"v1/mdc/{NS}x/backend/generate/44", card(NS + "x", 0x44))
    etcd.put(f"v1/instances/{NS}x/backend/generate/44", instance(NS + "x", 0x44))
    # The first endpoint does not answer: the next one is asked.
    reader = EtcdFleetDiscovery(["http://127.0.0.1:1", etcd.url], NS, timeout_s=2)
    workers = reader.workers()
    assert [(w.instance_id, w.admin_url) for w in workers] == [
        (0x11, "http://127.0.0.1:9017"),
        (0x33, "http://127.0.0.1:9051"),
    ]
    # Both prefixes read in one transaction (one revision).
    (request,) = etcd.requests
    keys = [base64.b64decode(op["request_range"]["key"]) for op in request["success"]]
    assert keys == [f"v1/mdc/{NS}/backend/generate/".encode(),
                    f"v1/instances/{NS}/backend/generate/".encode()]  # fmt: skip


def test_etcd_that_does_not_answer_raises() -> None:
    with pytest.raises(ConnectionError, match="every endpoint"):
        EtcdFleetDiscovery(["http://127.0.0.1:1"], NS, timeout_s=1).workers()


async def test_refit_clients_are_built_from_discovery(store: FileStore) -> None:
    store.worker(NS, 1)
    store.worker(NS, 2)
    discovery = FileFleetDiscovery(store.root, NS)
    routes = RefitClient.from_discovery(NS, discovery=discovery, timeout_s=5)
    assert routes.worker_urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [w.instance_id for w in routes.discovered] == [1, 2]
    await routes.close()
    async with EngineRefitClient.from_discovery(NS, discovery=discovery) as engines:
        assert engines.engines == ["unix:/tmp/engine-1.sock", "unix:/tmp/engine-2.sock"]
    with pytest.raises(ValueError, match="no live worker of nsfleet/backend serving 'x'"):
        RefitClient.from_discovery(NS, model="x", discovery=discovery)


async def test_a_worker_without_what_the_client_needs_is_refused(store: FileStore) -> None:
    store.worker(NS, 1)
    no_routes = worker_runtime_data(admin_url=None, engine_address="h:1", engine_tls=True)
    store.worker(NS, 2, entry=no_routes)
    discovery = FileFleetDiscovery(store.root, NS)
    with pytest.raises(ValueError, match=r"1 of the 2 workers .* published no admin_url"):
        RefitClient.from_discovery(NS, discovery=discovery)
    with pytest.raises(ValueError, match=r"\['h:1'\] are reached over TLS: give tls="):
        EngineRefitClient.from_discovery(NS, discovery=discovery)
    # With TLS options (the system's roots here) it is built; nothing is dialled yet.
    async with EngineRefitClient.from_discovery(NS, discovery=discovery, tls=TlsOptions()) as c:
        assert c.engines == ["unix:/tmp/engine-1.sock", "h:1"]
