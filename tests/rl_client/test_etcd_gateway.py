"""etcd's JSON gateway client: an answer it cannot use is a ConnectionError naming
why, never a crash (a hostile or broken gateway on the trainer's or bridge's path)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from rl_client import etcd_gateway


class Gateway:
    """A gateway on loopback answering each POST with the next body queued."""

    def __init__(self) -> None:
        bodies: list[bytes] = []
        self.bodies = bodies
        # The status each answer goes with (200 once the queue is empty).
        statuses: list[int] = []
        self.statuses = statuses
        self.posts = 0

        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                gateway.posts += 1
                body = bodies.pop(0)
                self.send_response(statuses.pop(0) if statuses else 200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def call(self, body: bytes) -> dict[str, object]:
        self.bodies.append(body)
        return etcd_gateway.call([self.url], "kv/range", {"key": "eA=="}, timeout_s=5)


def serve() -> Iterator[Gateway]:
    g = Gateway()
    try:
        yield g
    finally:
        g.server.shutdown()
        g.server.server_close()


gateway = pytest.fixture(serve, name="gateway")
second_gateway = pytest.fixture(serve, name="second_gateway")


def test_an_object_answer_is_returned(gateway: Gateway) -> None:
    assert gateway.call(b'{"kvs": []}') == {"kvs": []}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
        (b"[1, 2]", "not an object"),
        (b"{not json", "Expecting property name"),
    ],
)
def test_an_unusable_answer_is_a_connection_error_naming_why(
    gateway: Gateway, body: bytes, why: str
) -> None:
    with pytest.raises(ConnectionError, match=why):
        gateway.call(body)


def test_an_oversized_answer_is_refused(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_gateway, "MAX_ANSWER_BYTES", 100)
    with pytest.raises(ConnectionError, match="over 100 bytes"):
        gateway.call(b'{"kvs": "' + b"x" * 200 + b'"}')


def test_a_4xx_is_etcds_answer_and_no_other_endpoint_is_asked(
    gateway: Gateway, second_gateway: Gateway
) -> None:
    gateway.statuses.append(404)
    gateway.bodies.append(b'{"error": "etcdserver: requested lease not found", "code": 5}')
    second_gateway.bodies.append(b"{}")
    with pytest.raises(etcd_gateway.EtcdRefused, match="HTTP 404") as refused:
        etcd_gateway.call([gateway.url, second_gateway.url], "lease/revoke", {"ID": "1"}, 5)
    assert refused.value.status == 404
    assert second_gateway.posts == 0


def test_a_5xx_goes_on_to_the_next_endpoint(gateway: Gateway, second_gateway: Gateway) -> None:
    gateway.statuses.append(503)
    gateway.bodies.append(b'{"error": "etcdserver: no leader"}')
    second_gateway.bodies.append(b'{"kvs": []}')
    answer = etcd_gateway.call([gateway.url, second_gateway.url], "kv/range", {"key": "eA=="}, 5)
    assert answer == {"kvs": []}
    assert (gateway.posts, second_gateway.posts) == (1, 1)
