"""TLS from the bridge to a remote engine server: a CA to verify the server, and a
client certificate and key for mutual TLS (the engine server's ``--tls-client-ca``).

gRPC says no more than UNAVAILABLE when a handshake fails, and a bridge would wait
out its whole start-up timeout for a server that will never accept it. So when
the server does not answer, ``diagnose`` repeats the handshake with Python's own
TLS, which names the reason: the server's certificate not signed by our CA (or
expired, or for another name), the server asking for a client certificate we do
not have, rejecting ours (expired, unknown CA), or not speaking TLS at all.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

# What the server says when it refuses our certificate (TLS alerts), in words.
_ALERTS = {
    "CERTIFICATE_REQUIRED": "the engine server requires a client certificate and the bridge "
    "has none (give --engine-tls-cert and --engine-tls-key)",
    "CERTIFICATE_EXPIRED": "the engine server refused the bridge's client certificate: "
    "it has expired (or is not yet valid)",
    "UNKNOWN_CA": "the engine server refused the bridge's client certificate: it is not "
    "signed by a CA the server trusts (its --tls-client-ca)",
    "BAD_CERTIFICATE": "the engine server refused the bridge's client certificate",
    "HANDSHAKE_FAILURE": "the engine server refused the handshake (no client certificate, "
    "or no common protocol)",
}


@dataclass(frozen=True)
class TlsOptions:
    """PEM files; any one given turns TLS on. No CA: the system's roots."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # The name the server's certificate must carry when it differs from the host
    # in the address (an IP address, a tunnel).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError(
                "--engine-tls-cert and --engine-tls-key go together (a client certificate "
                "needs its key)"
            )
        for flag, path in (
            ("--engine-tls-ca", self.ca_file),
            ("--engine-tls-cert", self.cert_file),
            ("--engine-tls-key", self.key_file),
        ):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.ca_file:
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except ssl.SSLError as e:
                raise ValueError(
                    f"--engine-tls-ca {self.ca_file}: not a PEM CA bundle ({e})"
                ) from None
        if self.cert_file and self.key_file:
            try:
                ssl.create_default_context().load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as e:
                raise ValueError(
                    f"--engine-tls-cert {self.cert_file} / --engine-tls-key {self.key_file}: "
                    f"not a certificate and its key ({e})"
                ) from None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def describe(self) -> str:
        parts = [f"CA {self.ca_file or '(system roots)'}"]
        parts.append(f"client certificate {self.cert_file}" if self.cert_file else "no client cert")
        if self.server_name:
            parts.append(f"server name {self.server_name}")
        return ", ".join(parts)


def aio_channel(
    address: str, tls: TlsOptions | None, options: list[tuple[str, int | str]]
) -> grpc.aio.Channel:
    """A channel to an engine server: TLS with ``tls``, plaintext without (loopback
    and unix sockets). ``options`` include ``tls.channel_options()``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


def _host_port(address: str) -> tuple[str, int] | None:
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    address = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _validity(cert_file: str) -> tuple[float, float] | None:
    """(not before, not after) of a PEM certificate, seconds since the epoch."""
    try:
        decoded = ssl._ssl._test_decode_cert(cert_file)  # type: ignore[attr-defined]
        return (
            ssl.cert_time_to_seconds(decoded["notBefore"]),
            ssl.cert_time_to_seconds(decoded["notAfter"]),
        )
    except (AttributeError, KeyError, ValueError, ssl.SSLError):
        return None


def _refused_client_certificate(tls: TlsOptions) -> str:
    """The server closed the connection right after the handshake: it did not accept
    our client certificate. Which reason, as far as we can tell from here."""
    if not tls.cert_file:
        return _ALERTS["CERTIFICATE_REQUIRED"]
    validity = _validity(tls.cert_file)
    now = time.time()
    if validity is not None and not validity[0] <= now <= validity[1]:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(validity[1]))
        return (
            f"the engine server refused the bridge's client certificate {tls.cert_file}: "
            f"it has expired (valid until {when}) or is not yet valid"
        )
    return (
        f"the engine server refused the bridge's client certificate {tls.cert_file} "
        "(in date, so probably not signed by a CA the server trusts: its --tls-client-ca)"
    )


def diagnose(address: str, tls: TlsOptions, timeout_s: float = 3.0) -> str | None:
    """Why a TLS connection to ``address`` fails, in words, or None when the handshake
    succeeds (or nothing answers: not a TLS problem). Blocking: run it in a thread."""
    target = _host_port(address)
    if target is None:
        return None
    host, port = target
    context = ssl.create_default_context(cafile=tls.ca_file)
    context.set_alpn_protocols(["h2"])
    if tls.cert_file and tls.key_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    name = tls.server_name or host
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=name) as conn,
        ):
            # TLS 1.3: the server judges our certificate after the handshake ends
            # on our side; its verdict (an alert, or its HTTP/2 settings) follows.
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            if conn.recv(1):
                return None
            # Closed without a word (BoringSSL, gRPC's TLS, sends no alert then).
            return _refused_client_certificate(tls)
    except ssl.SSLCertVerificationError as e:
        reason = e.verify_message or str(e)
        if e.verify_code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
            return f"the engine server's certificate has expired ({reason})"
        if "hostname" in reason.lower() or "ip address mismatch" in reason.lower():
            return (
                f"the engine server's certificate is not for {name!r} ({reason}); "
                "--engine-tls-server-name sets the name to expect"
            )
        return (
            f"the engine server's certificate is not trusted by --engine-tls-ca "
            f"{tls.ca_file or '(system roots)'}: wrong CA? ({reason})"
        )
    except ssl.SSLError as e:
        text = f"{e.reason or ''} {e}".upper()
        for alert, words in _ALERTS.items():
            if alert in text:
                return f"{words} ({e.reason})"
        if "WRONG_VERSION_NUMBER" in text or "RECORD_LAYER_FAILURE" in text:
            return "the engine server does not speak TLS (it serves in clear text)"
        return f"TLS handshake failed: {e}"
    except (ConnectionError, TimeoutError, OSError):
        return None
    return None
