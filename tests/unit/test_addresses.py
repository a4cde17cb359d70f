from __future__ import annotations

import pytest

from engine_server.addresses import parse_listen_address


@pytest.mark.parametrize(
    ("text", "loopback", "target"),
    [
        ("127.0.0.1:0", True, "127.0.0.1:0"),
        ("localhost:5", True, "localhost:5"),
        ("[::1]:7", True, "[::1]:7"),
        ("127.1.2.3:9", True, "127.1.2.3:9"),
        ("0.0.0.0:80", False, "0.0.0.0:80"),
        ("[::]:80", False, "[::]:80"),
        ("10.0.0.1:80", False, "10.0.0.1:80"),
        ("example.com:80", False, "example.com:80"),
        ("unix:/tmp/x.sock", True, "unix:/tmp/x.sock"),
        ("unix:///tmp/x.sock", True, "unix:/tmp/x.sock"),
    ],
)
def test_a_listen_address_parses_to_its_loopbackness_and_grpc_target(
    text: str, loopback: bool, target: str
) -> None:
    address = parse_listen_address(text)
    assert address.is_loopback() is loopback
    assert address.grpc_target() == target


@pytest.mark.parametrize("text", ["nohost", ":80", "h:abc", "h:70000", "unix:", "[::1]80"])
def test_bad_addresses_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(ValueError, match="listen address"):
        parse_listen_address(text)
