"""Certificates made in the test (``cryptography``): a CA, a second CA nobody
trusts, a server certificate for given IP addresses, client certificates, and
expired ones, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

Key = ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._cas: dict[str, tuple[x509.Certificate, Key]] = {}

    def _write(self, name: str, cert: x509.Certificate, key: Key) -> tuple[Path, Path]:
        cert_path, key_path = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return cert_path, key_path

    def ca(self, name: str) -> Path:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        self._cas[name] = (cert, key)
        return self._write(name, cert, key)[0]

    def leaf(
        self,
        name: str,
        ca: str,
        *,
        server_ips: tuple[str, ...] = (),
        expired: bool = False,
    ) -> tuple[Path, Path]:
        """A server certificate (with ``server_ips``) or a client certificate, signed
        by ``ca``; ``expired``: valid only until yesterday."""
        ca_cert, ca_key = self._cas[ca]
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=2)
        if expired:
            start, end = now - datetime.timedelta(days=3), now - datetime.timedelta(days=1)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_ips else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server_ips:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
                ),
                critical=False,
            )
        return self._write(name, builder.sign(ca_key, hashes.SHA256()), key)
