"""TLS for every gRPC server and client, and HTTPS for the gateway's HTTP API.

Three PEM files, the same for every process of a mesh (one CA; each service is a server
and a client of the others):

    KVMESH_TLS_CERT / --tls-cert   this process's certificate (server, and client identity)
    KVMESH_TLS_KEY  / --tls-key    its private key
    KVMESH_TLS_CA   / --tls-ca     the CA that signed the peers' certificates
    KVMESH_TLS_SERVER_NAME         the name to check servers' certificates against, when
                                   the address dialled is not in them (optional)

Servers (kvmesh/rpc.py `Server`): with a cert and key they serve TLS only; with a CA as
well every client must present a certificate that CA signed (mutual TLS), the gateway's
public gRPC API included. Clients (`channel()`, the health check): with a CA or a cert
they dial TLS, verify the server against the CA and present their own certificate. The
HTTP API serves HTTPS with the same cert and key; its callers authenticate with API keys,
not certificates (the `openai` client has no place for one).

KVMESH_TLS_HEALTH_PORT=N (a TLS server only) adds a plaintext port N on the server's host
that serves grpc.health.v1 and nothing else: for probes that cannot present a client
certificate (Kubernetes' gRPC probes). It answers SERVING / NOT_SERVING, which is no secret.

With KVMESH_TLS_PUBLIC=off the gateway's public gRPC and HTTP ports serve plaintext while
its channels to the engines (and every other service's ports and channels) keep TLS: how
`kvmesh up` runs by default, with a CA it makes per run (kvmesh/run_ca.py).

Flags exist on every command that serves or calls gRPC; `export_flags` copies given flags
into this process's environment, so every channel the process opens (engine -> kvstore,
directory, peers; gateway -> engines) uses them, as the service token does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV = {"cert": "KVMESH_TLS_CERT", "key": "KVMESH_TLS_KEY", "ca": "KVMESH_TLS_CA",
       "server_name": "KVMESH_TLS_SERVER_NAME"}
# "off": the gateway's public ports (gRPC API and HTTP) serve plaintext while every
# internal channel keeps the files above (`kvmesh up`'s per-run CA: its users have no
# certificate of that CA; they authenticate with API keys).
PUBLIC_ENV = "KVMESH_TLS_PUBLIC"
HEALTH_PORT_ENV = "KVMESH_TLS_HEALTH_PORT"


def health_port_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """KVMESH_TLS_HEALTH_PORT: the plaintext health-only port; None when unset."""
    value = (os.environ if env is None else env).get(HEALTH_PORT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{HEALTH_PORT_ENV} = {value!r} is not a port number")
    return int(value)


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS: give both a certificate (KVMESH_TLS_CERT, --tls-cert) and "
                             "its key (KVMESH_TLS_KEY, --tls-key), or neither")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"TLS: {ENV[name]} = {path!r} is not a readable file")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsFiles:
        env = os.environ if env is None else env
        return cls(**{field: env.get(var, "").strip() for field, var in ENV.items()})

    @classmethod
    def public_from_env(cls, env: Mapping[str, str] | None = None) -> TlsFiles:
        """What the gateway's public ports serve: the process's files, or none when
        $KVMESH_TLS_PUBLIC is "off"."""
        env = os.environ if env is None else env
        if env.get(PUBLIC_ENV, "").strip().lower() == "off":
            return cls()
        return cls.from_env(env)

    @property
    def server_enabled(self) -> bool:
        return bool(self.cert)

    @property
    def client_enabled(self) -> bool:
        return bool(self.ca or self.cert)

    @property
    def mutual(self) -> bool:
        """Servers require client certificates signed by the CA."""
        return bool(self.cert and self.ca)

    def env(self) -> dict[str, str]:
        """The variables that give a child process these files."""
        return {var: getattr(self, field) for field, var in ENV.items() if getattr(self, field)}

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def server_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))],
                                           root_certificates=self._read("ca"),
                                           require_client_auth=self.mutual)

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"),
                                            private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_flags(parser) -> None:
    """--tls-cert/--tls-key/--tls-ca on a command that serves or calls gRPC."""
    group = parser.add_argument_group("TLS (see kvmesh/tls.py; flags override KVMESH_TLS_*)")
    group.add_argument("--tls-cert", help="PEM certificate of this process "
                       "(default $KVMESH_TLS_CERT or none = plaintext)")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert "
                       "(default $KVMESH_TLS_KEY)")
    group.add_argument("--tls-ca", help="PEM CA that signed the peers' certificates; servers "
                       "then require client certificates (mutual TLS) "
                       "(default $KVMESH_TLS_CA)")


def export_flags(args) -> None:
    """Put given --tls-* flags into os.environ: the one place this process reads TLS from."""
    for field in ("cert", "key", "ca"):
        value = getattr(args, f"tls_{field}", None)
        if value:
            os.environ[ENV[field]] = str(Path(value).resolve())
