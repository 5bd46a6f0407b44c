"""Internal clients prove the token instead of sending it (issue 44): a proof is good for
one call of one method within the window, once, and says nothing of the token."""

from __future__ import annotations

import pytest

from kvmesh.rpc_proof import SCHEME, WINDOW_S, ProofCheck, prove

TOKEN = "s3rvice-token-0123456789"
GEN = "/kvmesh.engine.v1.EngineService/Generate"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_fresh_proof_is_accepted_once():
    clock = Clock()
    check = ProofCheck(clock=clock)
    value = prove(TOKEN, GEN, now=clock.now)
    assert value.startswith(SCHEME + " ") and TOKEN not in value
    assert check.verify(value, GEN, TOKEN) is None
    assert check.verify(value, GEN, TOKEN) == "proof used before"


@pytest.mark.parametrize("case, why", [
    ("other method", "wrong token"),
    ("other token", "wrong token"),
    ("too old", "s from this server's clock"),
    ("from the future", "s from this server's clock"),
    ("malformed", "malformed proof"),
    ("tampered mac", "wrong token"),
])
def test_a_proof_for_anything_else_is_refused(case, why):
    clock = Clock()
    check = ProofCheck(clock=clock)
    at = {"too old": clock.now - WINDOW_S - 1, "from the future": clock.now + WINDOW_S + 1}
    value = prove("another-token" if case == "other token" else TOKEN,
                  "/kvmesh.kvstore.v1.KvstoreService/Put" if case == "other method" else GEN,
                  now=at.get(case, clock.now))
    if case == "malformed":
        value = f"{SCHEME} not-a-proof"
    if case == "tampered mac":
        value = value[:-1] + ("0" if value[-1] != "0" else "1")
    got = check.verify(value, GEN, TOKEN)
    assert got is not None and why in got


def test_seen_nonces_are_forgotten_once_their_proofs_expire():
    clock = Clock()
    check = ProofCheck(clock=clock)
    for i in range(100):
        assert check.verify(prove(TOKEN, GEN, now=clock.now, nonce=f"nonce{i:04d}"), GEN, TOKEN) is None
    assert len(check.seen) == 100
    clock.now += 2 * WINDOW_S + 1
    assert check.verify(prove(TOKEN, GEN, now=clock.now), GEN, TOKEN) is None
    assert len(check.seen) == 1                    # memory bounded by the calls of a window
