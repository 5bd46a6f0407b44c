"""Credentials: gateway API keys (key -> tenant, role) and the internal service/admin tokens.

API keys guard the public gateway (gRPC `authorization: Bearer <key>` metadata and HTTP
`Authorization: Bearer <key>`); `ApiKeys.authenticate` is the one check both use. Only
sha256 digests of keys are held in memory and every comparison is constant-time
(`hmac.compare_digest`), so neither a memory dump nor response timing gives a key away.

Internal RPCs (engine, kvstore, directory) are guarded by a shared service token,
`KVMESH_SERVICE_TOKEN`, and the kvstore's admin RPCs by `KVMESH_ADMIN_TOKEN`
(`TokenGuard` in kvmesh/rpc_auth.py checks them; `token_interceptors` there sends them).
A missing credential is UNAUTHENTICATED, a wrong one PERMISSION_DENIED.

Nothing here is mutable after construction: an `ApiKeys` is built once at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import InvalidArgument, KvmeshError

TENANT_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
ROLES = ("user", "admin")
SERVICE_TOKEN_ENV = "KVMESH_SERVICE_TOKEN"
ADMIN_TOKEN_ENV = "KVMESH_ADMIN_TOKEN"


class Unauthenticated(KvmeshError):
    """No credential, or one nobody issued: gRPC UNAUTHENTICATED, HTTP 401."""


class PermissionDenied(KvmeshError):
    """A credential that is known but not good for this call: PERMISSION_DENIED, HTTP 403."""


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def bearer(value: str | None) -> str | None:
    """The token of an `authorization` value `Bearer <token>`; None when absent or malformed."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def metadata_value(metadata, name: str) -> str | None:
    """One gRPC metadata value by (lower-case) key; None when absent."""
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class ApiKeys:
    """key digest -> Principal, from a keys file of `key tenant role` lines ('#' comments)."""

    def __init__(self, entries: Mapping[str, Principal]):
        if not entries:
            raise InvalidArgument("the API keys file has no keys")
        self._by_digest = [(digest(k), p) for k, p in entries.items()]

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        entries: dict[str, Principal] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 3:
                raise InvalidArgument(f"{path}:{n}: expected 'key tenant role', got "
                                      f"{len(parts)} fields")
            key, tenant, role = parts
            if len(key) < 16:
                raise InvalidArgument(f"{path}:{n}: a key must be at least 16 characters")
            if not TENANT_RE.fullmatch(tenant):
                raise InvalidArgument(f"{path}:{n}: tenant must be 1-64 characters of "
                                      "[A-Za-z0-9._:-]")
            if role not in ROLES:
                raise InvalidArgument(f"{path}:{n}: role must be one of {', '.join(ROLES)}, "
                                      f"got {role!r}")
            if key in entries:
                raise InvalidArgument(f"{path}:{n}: duplicate key")
            entries[key] = Principal(tenant, role)
        return cls(entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `authorization` header/metadata value, or Unauthenticated."""
        token = bearer(authorization)
        if token is None:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        d = digest(token)
        found = None
        for known, principal in self._by_digest:  # no early exit: time does not depend on which
            if hmac.compare_digest(d, known):
                found = principal
        if found is None:
            raise Unauthenticated("unknown API key")
        return found


def tenant_salt(tenant: str, salt: str) -> str:
    """The cache salt the engines see: the tenant's namespace, subdivided by the request's."""
    return f"tenant:{tenant}/{salt}"


def tenant_request_id(tenant: str, request_id: str) -> str:
    return f"{tenant}/{request_id}"


def read_token(env_name: str, file: str | None = None, env: Mapping[str, str] | None = None
               ) -> str:
    """A token from a file (first line) if given, else from the environment; '' = none."""
    if file:
        return Path(file).read_text().strip()
    return (os.environ if env is None else env).get(env_name, "").strip()


def check_token(presented: str | None, expected: str, what: str) -> None:
    """Unauthenticated when nothing was presented, PermissionDenied when it does not match."""
    if presented is None:
        raise Unauthenticated(f"missing {what}: send 'authorization: Bearer <token>'")
    if not hmac.compare_digest(digest(presented), digest(expected)):
        raise PermissionDenied(f"wrong {what}")


ALLOW_UNAUTHENTICATED_FLAG = "--allow-unauthenticated"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; a name or wildcard (0.0.0.0, ::) is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's view
    return (mapped or addr).is_loopback


def check_public_bind(host: str, has_api_keys: bool, allowed: bool) -> None:
    """Refuse to serve the public API beyond loopback without API keys: anyone on the
    network could generate, and read the cache-hit accounting of every prompt. The
    operator may still do so on purpose (a trusted network, auth in front) with
    `--allow-unauthenticated`."""
    if has_api_keys or allowed or is_loopback(host):
        return
    raise InvalidArgument(
        f"host {host!r} is not a loopback address and no API keys are configured: anyone who "
        f"can reach it could use the mesh. Give --api-keys FILE, or pass "
        f"{ALLOW_UNAUTHENTICATED_FLAG} (KVMESH_GATEWAY_ALLOW_UNAUTHENTICATED=1) to serve "
        "without authentication anyway")
