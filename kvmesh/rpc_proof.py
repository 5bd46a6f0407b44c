"""Proofs of a token instead of the token: what kvmesh's own gRPC clients send.

A client that sent `authorization: Bearer <service token>` would hand the token to whoever
answers at the address it dials, and in plaintext mode (`kvmesh up --plaintext`) that may
be any process that took a dead service's port. So internal clients never send a token.
Each call carries a proof that the caller holds it:

    authorization: Kvmesh-Proof <unix seconds>.<nonce>.<mac>
    mac = HMAC-SHA256(token, "kvmesh-rpc-1|<method>|<unix seconds>|<nonce>")   (hex)

A server holding the token recomputes the mac; the seconds must be within WINDOW_S of its
clock and the nonce unseen within twice that (`ProofCheck` keeps them), so a proof is good
for one call of one method, once. What a squatter learns is such a proof, not the token:
it cannot call another method, or anything after WINDOW_S, and the token never leaves the
processes configured with it. (With mutual TLS, `kvmesh up`'s default, a squatter gets no
call at all.) Servers still take `Bearer <token>` from tools such as grpcurl.

Owners: `ProofCheck` (one per server, its event loop only) owns the seen nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

SCHEME = "Kvmesh-Proof"
WINDOW_S = 60.0          # clock difference tolerated between a client and a server
_DOMAIN = "kvmesh-rpc-1"


def _mac(token: str, method: str, seconds: int, nonce: str) -> str:
    msg = f"{_DOMAIN}|{method}|{seconds}|{nonce}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def prove(token: str, method: str, now: float | None = None, nonce: str | None = None) -> str:
    """The `authorization` value proving `token` for one call of `method`."""
    seconds = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(12)
    return f"{SCHEME} {seconds}.{nonce}.{_mac(token, method, seconds, nonce)}"


class ProofCheck:
    """Server side: is an `authorization` value a fresh, unused proof of `token` for
    `method`? `verify` answers None (yes) or why not."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.time):
        self.window_s, self.clock = window_s, clock
        self.seen: OrderedDict[str, float] = OrderedDict()    # nonce -> when it may be forgotten

    @staticmethod
    def is_proof(value: str | None) -> bool:
        return bool(value) and value.startswith(SCHEME + " ")

    def verify(self, value: str, method: str, token: str) -> str | None:
        try:
            seconds_text, nonce, mac = value[len(SCHEME) + 1:].strip().split(".")
            seconds = int(seconds_text)
        except ValueError:
            return "malformed proof"
        now = self.clock()
        if abs(now - seconds) > self.window_s:
            return f"proof from {seconds}, {now - seconds:+.0f} s from this server's clock"
        if not 8 <= len(nonce) <= 64 or not hmac.compare_digest(
                mac, _mac(token, method, seconds, nonce)):
            return "wrong token"
        self._forget(now)
        if nonce in self.seen:
            return "proof used before"
        self.seen[nonce] = now + 2 * self.window_s
        return None

    def _forget(self, now: float) -> None:
        """Drop nonces whose proofs have expired (they are kept in arrival order)."""
        while self.seen:
            nonce, until = next(iter(self.seen.items()))
            if until > now:
                return
            del self.seen[nonce]
