"""AsyncEngine under cancellation at the two moments that used to break the engine loop.

A caller can be cancelled while its `add` waits in the command queue (not yet claimed
by the engine thread) or while the engine thread is admitting it. Neither may raise on
the engine thread, fail a bystander's stream, or leave a sequence holding a slot.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.core.sampling import SamplingParams
from tests.engine.engines import random_prompt, serve_core

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def engine():
    eng = AsyncEngine(serve_core("--num-slots", "4", "--num-blocks", "64"))
    yield eng
    eng.shutdown()


async def collect(engine: AsyncEngine, prompt) -> list[int]:
    out = []
    async for ev in engine.generate(prompt, SamplingParams(**GREEDY)):
        out.extend(ev.token_ids)
    return out


async def idle_stats(engine: AsyncEngine) -> dict:
    for _ in range(200):
        stats = await engine.call(lambda core: core.stats())
        if stats["running"] == 0 and stats["waiting"] == 0:
            await engine.call(lambda core: core.check_integrity())
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError("engine did not become idle")


def test_cancel_while_add_is_queued(engine, caplog):
    gate = threading.Event()

    async def scenario():
        expected = await collect(engine, random_prompt(40, 1))
        # Hold the engine thread inside a call so the next adds stay queued.
        blocker = asyncio.ensure_future(engine.call(lambda core: gate.wait(10)))
        bystander = asyncio.ensure_future(collect(engine, random_prompt(40, 1)))
        victims = [asyncio.ensure_future(collect(engine, random_prompt(30, i)))
                   for i in range(2, 8)]
        await asyncio.sleep(0.05)
        for v in victims:
            v.cancel()
        await asyncio.sleep(0.05)        # let the cancellations reach their futures
        gate.set()
        await blocker
        assert await bystander == expected
        assert all(v.cancelled() for v in victims)
        return await idle_stats(engine)

    stats = asyncio.run(scenario())
    assert stats["slots_in_use"] == 0 and stats["blocks_in_use"] == 0
    assert "engine step failed" not in caplog.text


def test_cancel_during_admission(engine, caplog):
    """The engine thread has claimed the add; the caller leaves before it returns."""
    core = engine.core
    admitting, release = threading.Event(), threading.Event()
    real_add = core.add_request

    def slow_add(*args):
        admitting.set()
        release.wait(10)
        return real_add(*args)

    async def scenario():
        expected = await collect(engine, random_prompt(40, 1))
        core.add_request = slow_add
        victim = asyncio.ensure_future(collect(engine, random_prompt(30, 9)))
        await asyncio.get_running_loop().run_in_executor(None, admitting.wait, 10)
        core.add_request = real_add
        victim.cancel()
        await asyncio.sleep(0.05)
        release.set()
        assert await collect(engine, random_prompt(40, 1)) == expected
        assert victim.cancelled()
        return await idle_stats(engine)

    stats = asyncio.run(scenario())
    assert stats["slots_in_use"] == 0 and stats["blocks_in_use"] == 0
    assert "engine step failed" not in caplog.text


def test_cancelled_call_is_skipped(engine):
    """A call whose caller left is not run, and the engine keeps serving."""
    gate, ran = threading.Event(), []

    async def scenario():
        blocker = asyncio.ensure_future(engine.call(lambda core: gate.wait(10)))
        skipped = asyncio.ensure_future(engine.call(lambda core: ran.append(1)))
        await asyncio.sleep(0.05)
        skipped.cancel()
        await asyncio.sleep(0.05)        # let the cancellation reach its future
        gate.set()
        await blocker
        return await collect(engine, random_prompt(20, 3))

    assert len(asyncio.run(scenario())) == GREEDY["max_tokens"]
    assert ran == []
