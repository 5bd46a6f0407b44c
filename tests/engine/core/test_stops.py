"""Stop strings: the incremental matcher against a plain re-search, and the engine's bounds."""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.services.engine.core.sampling import MAX_STOP_BYTES, MAX_STOPS
from kvmesh.services.engine.core.stops import StopMatcher
from kvmesh.services.engine.rpc.client import generate_request
from tests.engine.rpc.test_service import h  # noqa: F401 - the module's engine harness fixture

ALPHABET = "ab\u00e9"       # few letters: overlaps and repeats are common


def plain_first_match(text: str, fed: int, stops) -> tuple[int, int] | None:
    """The earliest-ending stop string that ends after position `fed` (the longest of
    those that end at the same place), by searching the whole text."""
    best = None
    for s in stops:
        start = text.find(s)
        while start != -1:
            end = start + len(s)
            if end > fed:
                if best is None or end < best[0] or (end == best[0] and len(s) > best[1]):
                    best = (end, len(s))
                break
            start = text.find(s, start + 1)
    return best


def plain_hold(text: str, stops) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=30))
def test_matcher_agrees_with_plain_search(stops, chunks):
    m, text = StopMatcher(tuple(stops)), ""
    for chunk in chunks:
        fed = len(text)
        text += chunk
        hit = m.feed(chunk)
        want = plain_first_match(text, fed, stops)
        if want is None:
            assert hit is None
            assert m.hold == plain_hold(text, stops)
        else:
            assert hit is not None and (fed + hit[0], hit[1]) == want
            return  # generation ends at the first stop string


def test_long_stop_string_costs_what_new_text_costs():
    """A stop string of MAX_STOP_BYTES that keeps almost matching: feeding 20,000
    characters stays linear (the quadratic prefix scan took seconds here)."""
    stop = "a" * (MAX_STOP_BYTES - 1) + "b"
    m = StopMatcher((stop,) * 8)
    t0 = time.perf_counter()
    for _ in range(5000):
        assert m.feed("aaaa") is None
    assert m.hold == MAX_STOP_BYTES - 1
    assert time.perf_counter() - t0 < 5.0
    assert m.feed("b") == (1, MAX_STOP_BYTES)


@pytest.mark.parametrize("stop,field", [
    (["x" * (1 << 20)], f"at most {MAX_STOP_BYTES}"),
    (["\u00e9" * (MAX_STOP_BYTES // 2 + 1)], f"at most {MAX_STOP_BYTES}"),
    (["s"] * (MAX_STOPS + 1), f"at most {MAX_STOPS}"),
    (["ok", ""], "stop[1] is empty"),
])
def test_engine_bounds_stop_strings(h, stop, field):  # noqa: F811
    async def call():
        req = generate_request([1, 2, 3], max_tokens=4)
        req.stop.extend(stop)
        return [m async for m in h.client.stub.Generate(req, timeout=30)]

    t0 = time.perf_counter()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.run(call())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    assert time.perf_counter() - t0 < 5.0


def test_engine_stops_at_a_stop_string(h):  # noqa: F811
    """The stop string is cut from the text, and nothing after it is sent."""
    async def run(stop):
        req = generate_request([10, 11, 12], max_tokens=40, temperature=0.0)
        req.ignore_eos = True
        req.stop.extend(stop)
        return [m async for m in h.client.stub.Generate(req, timeout=30)]

    full = "".join(m.text for m in h.run(run([])))
    stop = full[5:8]
    cut = h.run(run([stop]))
    assert "".join(m.text for m in cut) == full[: full.find(stop)]
    assert cut[-1].finish_reason != 0


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
       text=st.text(ALPHABET, min_size=1, max_size=30), max_tokens=st.integers(1, 40))
def test_output_sends_what_a_plain_search_allows(stops, text, max_tokens):
    """OutputState (the engine's per-request text state) keeps only the unsent text; after
    every token, what it has sent is what a search of the whole text allows: everything
    before the first stop string (then STOP), or everything at max_tokens (LENGTH), or
    everything but the longest end that may still begin a stop string."""
    from kvmesh.services.engine.core.finish import Finish
    from kvmesh.services.engine.core.output import OutputState
    from kvmesh.services.engine.core.sampling import SamplingParams
    from kvmesh.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.encode(text)                    # é is two byte tokens: split characters too
    out = OutputState(SamplingParams(max_tokens=max_tokens, stop=stops), tok.eos_id, tok.stream())
    sent = ""
    for n, token in enumerate(ids, start=1):
        delta, finish = out.push(token, n)
        sent += delta
        full = tok.decode(ids[:n]).rstrip("\ufffd")
        hit = plain_first_match(full, 0, stops)
        if hit is not None:
            assert (sent, finish) == (full[: hit[0] - hit[1]], Finish.STOP)
            return
        if n >= max_tokens:
            assert (sent, finish) == (full, Finish.LENGTH)
            return
        assert finish is None and sent == full[: len(full) - plain_hold(full, stops)]


def test_output_never_reads_the_whole_text():
    """A push costs what its token costs: the stream's whole text is never joined for it."""
    from kvmesh.services.engine.core.output import OutputState
    from kvmesh.services.engine.core.sampling import SamplingParams
    from kvmesh.tokenizer import ByteTokenizer, TextStream

    tok = ByteTokenizer()
    out = OutputState(SamplingParams(max_tokens=10_000, stop=["zzz"]), tok.eos_id, tok.stream())
    reads = []
    real = TextStream.text
    TextStream.text = property(lambda self: reads.append(1) or real.fget(self))
    try:
        sent = "".join(out.push(t, n)[0] for n, t in enumerate(tok.encode("ab z" * 500), 1))
    finally:
        TextStream.text = real
    assert sent == ("ab z" * 500)[:-1] and not reads      # the last "z" may begin "zzz"
