"""A throwaway certificate authority for TLS tests, made with the `cryptography` package.

    ca = TestCA("kvmesh test CA")
    files = ca.issue(tmp_path, "mesh")     # TlsFiles: cert + key signed by ca, and ca.pem

Issued certificates name 127.0.0.1 and localhost (the addresses a local mesh dials) and
are good for both server and client authentication: every kvmesh process is both.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.tls import TlsFiles


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCA:
    __test__ = False  # not a pytest class

    def __init__(self, cn: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))

    def issue(self, directory: Path, name: str) -> TlsFiles:
        """A certificate and key for `name` signed by this CA, written beside ca.pem."""
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(name))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        paths = {"cert": directory / f"{name}.pem", "key": directory / f"{name}.key",
                 "ca": directory / "ca.pem"}
        paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths["key"].write_bytes(_pem_key(key))
        paths["key"].chmod(0o600)
        paths["ca"].write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return TlsFiles(**{k: str(v) for k, v in paths.items()})
