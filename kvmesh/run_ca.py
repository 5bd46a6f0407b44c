"""A certificate authority made for one mesh run: `kvmesh up` makes one per run so that
every internal gRPC port speaks mutual TLS and a process that is not of this run (one
that took a dead engine's port, say) can neither answer as a service nor receive a
request or the service token.

    files = make_run_ca(log_dir / "tls")   # TlsFiles: mesh.pem + mesh.key, signed by ca.pem

One certificate serves every process (each is a server and a client of the others): it
names 127.0.0.1, ::1 and localhost, the addresses a local mesh dials, and is good for
server and client authentication. The CA's key is never written: no certificate can be
issued for the run after it starts. Keys are written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.private_file import write_private
from kvmesh.tls import TlsFiles

RUN_DAYS = 30      # a run's certificates outlive any run; a new run makes new ones


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class LocalCA:
    """A CA held in memory; `issue` writes a certificate and key signed by it, and ca.pem."""

    def __init__(self, cn: str, days: int = 1):
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=days))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))

    def issue(self, directory: Path, name: str, hosts: tuple[str, ...] = ()) -> TlsFiles:
        """A certificate and key for `name` signed by this CA, written beside ca.pem; it
        names localhost, 127.0.0.1, ::1 and `hosts` (the DNS names services dial each
        other by in docker-compose or Kubernetes)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(name))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=self.days))
                .add_extension(x509.SubjectAlternativeName([
                    *(x509.DNSName(h) for h in ("localhost", *hosts)),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        paths = {"cert": directory / f"{name}.pem", "key": directory / f"{name}.key",
                 "ca": directory / "ca.pem"}
        write_private(paths["key"], _pem_key(key))
        paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths["ca"].write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return TlsFiles(**{k: str(v.resolve()) for k, v in paths.items()})


def make_run_ca(directory: Path, hosts: tuple[str, ...] = (), days: int = RUN_DAYS) -> TlsFiles:
    """A fresh CA and the run's one certificate (naming `hosts` too), in `directory`
    (replacing a previous run's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    return LocalCA("kvmesh run CA", days=days).issue(directory, "mesh", hosts)
