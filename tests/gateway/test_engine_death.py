"""An engine that dies while idle leaves the gateway's engine set within seconds (its port
refuses connections: GatewayCore.refresh_engines), not when its 10 s directory lease lapses
(the gateway lists `kvmesh up`'s engines statically too, so a lease alone never removes
one), and comes back when it listens again."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from tests.gateway.conftest import wait_for

MESH_OVERRIDES = dict(engines=2)


def engines_in_health(mesh) -> int:
    try:
        with urllib.request.urlopen(mesh.endpoints["gateway-http"] + "/health", timeout=5) as r:
            return json.loads(r.read())["engines"]
    except urllib.error.HTTPError as exc:          # 503: no engine
        return json.loads(exc.read())["engines"]


def test_a_killed_engine_leaves_the_set_within_5_s_and_comes_back(mesh, gw):
    assert wait_for(lambda: engines_in_health(mesh) == 2, timeout=30)
    mesh.kill("engine-a")
    t0 = time.monotonic()
    assert wait_for(lambda: engines_in_health(mesh) == 1, timeout=5, interval=0.05)
    gone_s = time.monotonic() - t0
    assert gone_s < 5
    print(f"engine-a left the set {gone_s:.2f} s after SIGKILL")
    # requests meanwhile go to the live engine, at the first attempt
    for i in range(4):
        out = gw.generate(f"{i} after the death of engine-a", max_tokens=4, temperature=0.0)
        assert out.engine_id == "engine-b" and out.attempts == 1
    mesh.restart("engine-a")
    assert wait_for(lambda: engines_in_health(mesh) == 2, timeout=60)
