"""Gateway core fast paths: snapshot keys with the cached fingerprint, which keys reach
the directory, the deferred request report, and the event-loop choice."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import pytest

from kvmesh import cachekeys
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.core import GatewayCore, GatewayRequest, ModelInfo
from kvmesh.services.gateway.model import GenRequest
from kvmesh.services.gateway.service import loop_name, run

# the served model's fields a GetModelInfo answer carries (the shipped model's geometry)
MODEL = {"name": "deepseek-v41-tiny", "model_type": "deepseek_v41", "vocab_size": 4096,
         "block_size": 128, "window": 128, "max_seq_len": 65536, "config": {"hidden_size": 256}}


class _Msg:
    """A GetModelInfo answer: every fake engine of these tests answers as the same engine."""
    model_config_json = json.dumps(MODEL)
    layout_fingerprint = "0123456789abcdef"
    model_fingerprint = "fedcba9876543210"
    engine_id = "engine-1"


async def model_info(address, timeout=2.0):
    """A fake pool's GetModelInfo (GatewayCore.check_identity asks it before a first request)."""
    return _Msg()


INFO = ModelInfo(_Msg())
BS = MODEL["block_size"]
W = MODEL["window"]


@pytest.mark.parametrize("n", [0, 1, BS - 1, BS, BS + 5, 3 * BS, 3 * BS + 7])
@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_snapshot_keys_match_prefix_snapshot_keys(n, salt):
    ids = [(7 * i) % MODEL["vocab_size"] for i in range(n)]
    fp = cachekeys.model_fingerprint(MODEL)
    want = [k for _, k in cachekeys.prefix_snapshot_keys(ids, BS, fp, _Msg.layout_fingerprint,
                                                         salt)]
    assert INFO.snapshot_keys(ids, salt) == want


def test_lookup_only_keys_an_engine_could_restore():
    # A snapshot at S is usable only if S <= L - KEEP, and KEEP >= window.
    w = W
    assert INFO.lookup_count(BS - 1) == 0
    assert INFO.lookup_count(BS + w - 1) == 0        # one key (affinity), no Lookup
    assert INFO.lookup_count(BS + w) == 1
    assert INFO.lookup_count(3 * BS + w) == 3
    for n in range(0, 5 * BS, 17):
        k = INFO.lookup_count(n)
        assert k <= n // BS and all((i + 1) * BS <= n - w for i in range(k))


def test_directory_asked_only_for_restorable_keys_and_affinity_keeps_all():
    asked = []

    class Directory:
        async def lookup(self, keys, timeout=None):
            asked.append(list(keys))
            return {}

    class Pool:
        model_info = staticmethod(model_info)

        def stream(self, address, msg, timeout):
            async def chunks():
                from kvmesh.services.gateway.model import Chunk, Usage
                yield Chunk([1], "x", "length", Usage(len(msg.prompt), 0, 0, 1))
            return chunks()

    async def go():
        core = GatewayCore(GatewayConfig(engines="127.0.0.1:1"), pool=Pool())
        core.directory, core.info = Directory(), INFO
        for n in (BS - 1, BS + 10, 2 * BS + W + 1):
            req = GenRequest("", "a" * n, None, max_tokens=1)
            assert [c.text async for c in core.open(req)] == ["x"]
            await asyncio.sleep(0)  # let the deferred report run
        return core

    core = asyncio.run(go())
    # 127 tokens: no keys; 138: one key, not restorable; 385: keys 128, 256 restorable
    assert asked == [INFO.snapshot_keys([97] * (2 * BS + W + 1), "")[:2]]
    # every boundary key is remembered: 128 (shared by both prompts), 256, 384
    assert set(core.router.affinity) == set(INFO.snapshot_keys([97] * (3 * BS), ""))


def test_report_is_deferred_but_always_happens(caplog):
    class Pool:
        model_info = staticmethod(model_info)

        def stream(self, address, msg, timeout):
            async def chunks():
                from kvmesh.services.gateway.model import Chunk, Usage
                yield Chunk([1], "x", "length", Usage(3, 0, 0, 1))
            return chunks()

    async def go():
        core = GatewayCore(GatewayConfig(engines="127.0.0.1:1"), pool=Pool())
        core.info = INFO
        out = [c async for c in core.open(GenRequest("rid-1", "abc", None, max_tokens=1))]
        before = [r.getMessage() for r in caplog.records if "request id=" in r.getMessage()]
        await asyncio.sleep(0)
        return out, before

    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        out, before = asyncio.run(go())
    assert out and before == []          # nothing logged on the request's path
    lines = [r.getMessage() for r in caplog.records if "request id=rid-1" in r.getMessage()]
    assert len(lines) == 1 and "status=OK" in lines[0] and "generated=1" in lines[0]


def test_report_without_a_running_loop_is_immediate(caplog):
    core = GatewayCore(GatewayConfig(engines="127.0.0.1:1"))
    gr = GatewayRequest(core, GenRequest("rid-2", "abc", None), None, "unary")
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        gr._finish("CANCELLED")
    assert any("request id=rid-2 status=CANCELLED" in r.getMessage() for r in caplog.records)


def test_event_loop_choice():
    assert loop_name("asyncio") == "asyncio"
    assert loop_name("auto") in ("asyncio", "uvloop")

    async def which():
        return type(asyncio.get_running_loop()).__module__

    assert run(which(), "asyncio").startswith("asyncio")
    # uvloop is a declared dependency and the default loop
    assert loop_name("auto") == "uvloop" and GatewayConfig().event_loop == "uvloop"
    assert run(which(), "uvloop").startswith("uvloop")
    with pytest.raises(ValueError, match="event_loop"):
        GatewayConfig(event_loop="trio")
    assert GatewayConfig.from_env({"KVMESH_GATEWAY_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"


def test_engine_sessions_switch():
    from kvmesh.services.gateway.cli import config_from_args, register

    assert GatewayConfig().engine_sessions is True
    assert GatewayConfig.from_env({"KVMESH_GATEWAY_ENGINE_SESSIONS": "0"}).engine_sessions is False
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    for argv, want in ((["gateway", "serve", "--engines", "h:1"], True),
                       (["gateway", "serve", "--engines", "h:1", "--engine-calls"], False)):
        assert config_from_args(ap.parse_args(argv)).engine_sessions is want
    assert GatewayCore(GatewayConfig(engines="h:1", engine_sessions=False)).pool.use_sessions is False
