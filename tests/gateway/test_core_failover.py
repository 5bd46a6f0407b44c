"""GatewayCore failover with scripted engines and a fake clock: retries before the first
token, migration after it, and which engines a request may go back to."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import Unavailable
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.core import GatewayCore
from kvmesh.services.gateway.model import Chunk, EngineFailure, GenRequest, Usage
from tests.gateway.test_core_keys import INFO, model_info

A, B = "127.0.0.1:1", "127.0.0.1:2"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class ScriptedPool:
    """The k-th engine call plays script[k]: (seconds it takes, tokens, then fail?), on
    whichever engine the router picked (recorded in `calls`)."""

    model_info = staticmethod(model_info)

    def __init__(self, clock: Clock, script: list[tuple[float, int, bool]]):
        self.clock, self.script, self.calls = clock, list(script), []

    def stream(self, address, msg, timeout):
        wait, n, fail = self.script.pop(0)
        self.calls.append((address, list(msg.prompt_token_ids), msg.resume_generated,
                           msg.sampling.seed))

        async def chunks():
            self.clock.now += wait
            for i in range(n):
                yield Chunk([10 + i + msg.resume_generated], "t", None, None)
            if fail:
                raise EngineFailure(f"{address} broke")
            yield Chunk([], "", "length", Usage(3, 0, 0, n + msg.resume_generated))
        return chunks()


def run(pool, clock, **cfg):
    async def go():
        core = GatewayCore(GatewayConfig(engines=f"{A},{B}", **cfg), pool=pool, clock=clock)
        core.info = INFO
        gr = core.open(GenRequest("r", None, [1, 2, 3], max_tokens=8))
        chunks = [c async for c in gr]
        await asyncio.sleep(0)
        return gr, chunks
    return asyncio.run(go())


def test_migration_resumes_with_the_delivered_tokens_and_a_pinned_seed():
    clock = Clock()
    pool = ScriptedPool(clock, [(0, 3, True), (0, 5, False)])
    gr, chunks = run(pool, clock)
    first, second = pool.calls
    assert first[0] != second[0]
    assert first[2] == 0 and second[2] == 3
    assert second[1] == [1, 2, 3, *first_tokens(chunks)[:3]]
    assert first[3] == second[3] != 0                    # the same pinned seed
    assert gr.migrations == 1 and gr.tokens == 8


def first_tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


def test_migration_limit_zero_fails_mid_stream():
    clock = Clock()
    pool = ScriptedPool(clock, [(0, 3, True), (0, 5, False)])
    with pytest.raises(Unavailable, match="failed mid-stream after 3 tokens"):
        run(pool, clock, migration_limit=0)


def test_an_engine_that_failed_long_ago_is_tried_again():
    """A fails before the first token; B serves a while and fails a minute later: the
    request goes back to A (restarted meanwhile) instead of giving up."""
    clock = Clock()
    pool = ScriptedPool(clock, [(0, 0, True), (60.0, 2, True), (0, 4, False)])
    gr, chunks = run(pool, clock)
    first, second, third = (c[0] for c in pool.calls)
    assert first != second and third == first
    assert gr.migrations == 1 and gr.tokens == 6


def test_engines_that_just_failed_are_not_retried():
    clock = Clock()
    pool = ScriptedPool(clock, [(0, 0, True), (0, 0, True), (0, 1, False)])
    with pytest.raises(Unavailable, match="after 2 attempts"):
        run(pool, clock)
    assert {c[0] for c in pool.calls} == {A, B} and len(pool.calls) == 2
