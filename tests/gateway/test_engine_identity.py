"""The gateway sends a request to an engine only once that address has answered who it is
(issue 44): first contact records (engine id, model fingerprint); after a failure the
address must answer the same again. Another process there (a restarted engine of another
model, or anything that took the port) is refused, and gets no request until the directory
registers the address again under a new engine id."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.core import GatewayCore
from kvmesh.services.gateway.model import Chunk, EngineFailure, GenRequest, Usage
from tests.gateway.test_core_failover import A, B, Clock
from tests.gateway.test_core_keys import INFO, _Msg


class Engines:
    """Fake engines by address: who each says it is, whether it is up; records every call."""

    def __init__(self):
        self.who = {A: ("engine-a", _Msg.model_fingerprint), B: ("engine-b", _Msg.model_fingerprint)}
        self.up = {A: True, B: True}
        self.asked, self.served = [], []

    async def model_info(self, address, timeout=2.0):
        self.asked.append(address)
        if not self.up[address]:
            raise EngineFailure(f"{address} down")
        engine_id, fp = self.who[address]
        return SimpleNamespace(engine_id=engine_id, model_fingerprint=fp)

    def stream(self, address, msg, timeout):
        async def chunks():
            if not self.up[address]:
                raise EngineFailure(f"{address} down")
            self.served.append(address)
            yield Chunk([1], "x", "length", Usage(3, 0, 0, 1))
        return chunks()


def gateway(engines, clock):
    core = GatewayCore(GatewayConfig(engines=f"{A},{B}"), pool=engines, clock=clock)
    core.info = INFO
    return core


def serve(core, n):
    async def go():
        for i in range(n):
            [c async for c in core.open(GenRequest(f"r{i}", None, [1, 2, 3], max_tokens=1))]
    asyncio.run(go())


def test_first_contact_asks_once_and_records_the_identity():
    engines, clock = Engines(), Clock()
    core = gateway(engines, clock)
    serve(core, 6)
    assert sorted(engines.asked) == [A, B]                  # once per engine, not per request
    assert len(engines.served) == 6
    st = core.router.engines[B]
    assert st.identity == ("engine-b", _Msg.model_fingerprint) and st.engine_id == "engine-b"


def test_a_restarted_engine_that_is_the_same_engine_is_used_again():
    engines, clock = Engines(), Clock()
    core = gateway(engines, clock)
    serve(core, 2)
    engines.up[B] = False
    serve(core, 4)                                          # B fails once, is marked down
    engines.up[B] = True
    clock.now += 10                                         # past down_s
    engines.asked.clear(), engines.served.clear()
    serve(core, 6)
    assert engines.asked == [B] and B in engines.served


def test_another_engine_on_a_dead_engines_address_gets_no_request():
    engines, clock = Engines(), Clock()
    core = gateway(engines, clock)
    serve(core, 2)
    engines.up[B] = False
    serve(core, 4)
    engines.up[B], engines.who[B] = True, ("squatter", _Msg.model_fingerprint)
    clock.now += 10
    engines.asked.clear(), engines.served.clear()
    serve(core, 8)
    assert engines.served == [A] * 8                        # every request, none on B
    assert engines.asked == [B]                             # asked once, then refused for good
    assert core.router.engines[B].refused
    # the directory registers the address again under a new name: the new identity is taken
    info = SimpleNamespace(engine_id="engine-b2", address=B, lease_left_ms=60_000,
                           load=SimpleNamespace(running_seqs=0, waiting_seqs=0))
    core.router.update_from_directory([info], clock.now)
    engines.who[B] = ("engine-b2", _Msg.model_fingerprint)
    clock.now += 10                                         # past the refusal's down time
    serve(core, 6)
    assert B in engines.served and core.router.engines[B].identity[0] == "engine-b2"


def test_an_engine_of_another_model_is_refused_at_first_contact():
    engines, clock = Engines(), Clock()
    engines.who[B] = ("engine-b", "another-model-fingerprint")
    core = gateway(engines, clock)
    serve(core, 6)
    assert engines.served == [A] * 6 and core.router.engines[B].refused
