"""Prefill on one engine, decode on another: the same tokens and logits as one unified engine.

In-process engines (float64, seeded random weights): a prefill engine (PE, extra-state on:
ring 396 with truncation compact, 262 with it off) runs each request with handoff=True,
samples the first token and keeps the handoff; a decode engine (CE, ring 134) adopts it
and decodes the rest. A unified engine (ring 134) runs the same requests in the same
order, so prefix hits (blocks, snapshots, bounded replay) are the same on both sides; for
cold prompts one unified run (chunk 128) is the reference of every chunk size.
Prompt lengths put the last prefill chunk's end at the offsets mod 128 (and mod the long
ring) that matter: on a block boundary, 1 past it, the B spare rows, 1 before it.
"""

import pytest
import torch

from kvmesh.errors import InvalidArgument, Unavailable
from services.engine.config import TINY
from services.engine.core.sampling import SamplingParams
from services.engine.core.sequence import Finish
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

LENGTHS = (135, 256, 257, 262, 263, 383, 397, 520)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=5)
WEIGHTS: dict = {}


def _engines(truncation: str, chunk: int, policy: str = "full"):
    kw = dict(truncation=truncation, keep_tokens=134 if truncation != "off" else 0,
              num_blocks=128, num_slots=16, max_batched_tokens=512, long_prefill_chunk=chunk,
              swa_policy=policy)
    w = WEIGHTS.setdefault("w", make_engine(TINY, num_blocks=1).weights)
    unified = make_engine(TINY, weights=w, **kw)
    pe = make_engine(TINY, weights=w, extra_state=True, **kw)
    ce = make_engine(TINY, weights=w, **kw)
    assert pe.cache.states.ring == (396 if truncation != "off" else 262)
    assert ce.cache.states.ring == unified.cache.states.ring == 134
    return unified, pe, ce


def _unified(engine, batches):
    """Each batch runs to completion before the next (so later ones hit earlier blocks)."""
    out = {}
    for batch in batches:
        seqs = [engine.add_request(p, params, request_id=rid) for rid, p, params in batch]
        run_to_completion(engine)
        out.update({s.request_id: (s.output, torch.stack(engine.logits[s.request_id])) for s in seqs})
    return out


def _disaggregated(pe, ce, batches):
    out = {}
    for batch in batches:
        for rid, p, params in batch:
            pe.add_request(p, params, request_id=rid, handoff=True)
        handoffs = []
        while pe.has_work:
            handoffs += [ev.handoff for ev in pe.step() if ev.finish is Finish.HANDOFF]
            pe.check_integrity()
        assert len(handoffs) == len(batch)
        seqs = [ce.adopt(h) for h in handoffs]
        run_to_completion(ce)
        for s in seqs:
            logits = pe.logits[s.request_id] + ce.logits[s.request_id]
            out[s.request_id] = (s.output, torch.stack(logits))
    return out


def _same(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert float((got[rid][1] - want[rid][1]).abs().max()) <= 1e-9, rid


def _cold_batches():
    return [[(f"{n}", random_prompt(n, n), GREEDY if i % 2 else SEEDED) for i, n in enumerate(LENGTHS)]]


REFERENCE: dict = {}


def _cold_reference(truncation: str):
    """The unified engine's tokens and logits, once per truncation mode (chunk 128): every
    chunk size of the disaggregated run is compared with the same reference."""
    if truncation not in REFERENCE:
        REFERENCE[truncation] = _unified(_engines(truncation, 128)[0], _cold_batches())
    return REFERENCE[truncation]


@pytest.mark.parametrize("truncation", ["compact", "off"])
@pytest.mark.parametrize("chunk", [7, 33, 128, 500])
def test_handoff_equals_unified_cold(truncation, chunk):
    _, pe, ce = _engines(truncation, chunk)
    batches = _cold_batches()
    want = _cold_reference(truncation)
    got = _disaggregated(pe, ce, batches)
    _same(got, want)
    assert pe.counters["handoffs_out"] == ce.counters["handoffs_in"] == len(batches[0])
    assert pe.counters["generated_tokens"] == len(batches[0])      # the first tokens only


def _hit_batches():
    """A first request, then prompts sharing its blocks (hits on the PE), incl. one whose
    hit lies on the decode engine's pool too (the same prefix handed off before)."""
    base = random_prompt(700, 99)
    first = [("first", base[:400], GREEDY)]
    second = [("longer", base[:560], GREEDY), ("fork", base[:300] + random_prompt(200, 5), SEEDED)]
    return [first, second]


@pytest.mark.parametrize("policy", ["full", "zero"])     # snapshot hit / bounded replay
@pytest.mark.parametrize("chunk", [33, 500])
def test_handoff_equals_unified_with_prefix_hits(policy, chunk):
    unified, pe, ce = _engines("compact", chunk, policy)
    batches = _hit_batches()
    want = _unified(unified, batches)
    got = _disaggregated(pe, ce, batches)
    _same(got, want)
    # "longer" resumes at the first prompt's prefill snapshot (384) under `full`; "fork"
    # shares 2 blocks and no snapshot: bounded replay
    for name in ("snapshot_hits", "snapshot_misses", "replayed_tokens", "cache_hit_tokens"):
        assert pe.counters[name] == unified.counters[name], name
    assert pe.counters["snapshot_hits"] == (1 if policy == "full" else 0)
    assert pe.counters["replayed_tokens"] > 0
    # the CE already held the shared complete blocks from the first handoff
    assert ce.counters["handoff_blocks_local"] > 0
    ce.check_integrity()


def test_adopt_refuses_damaged_or_foreign_handoffs():
    _, pe, ce = _engines("compact", 500)
    pe.add_request(random_prompt(300, 1), GREEDY, request_id="r", handoff=True)
    run_to_completion(pe)
    h = pe.handoffs.get("r")
    assert h is not None and h.nbytes == pe.counters["handoff_out_bytes"]
    from dataclasses import replace
    bad_state = replace(h, slot=replace(h.slot, state=h.slot.state[:-1]))
    with pytest.raises(InvalidArgument, match="handoff state is"):
        ce.adopt(bad_state)
    blocks = list(h.slot.blocks)
    blocks[0] = blocks[0][:100] + bytes([blocks[0][100] ^ 1]) + blocks[0][101:]
    with pytest.raises(InvalidArgument, match="digest"):
        ce.adopt(replace(h, slot=replace(h.slot, blocks=tuple(blocks))))
    with pytest.raises(InvalidArgument, match="fingerprint"):
        ce.adopt(replace(h, model_fp="0" * 64))
    with pytest.raises(InvalidArgument, match="ring is 396"):
        pe.adopt(h)                                   # a prefill engine keeps the long ring
    small = make_engine(TINY, weights=pe.weights, truncation="compact", keep_tokens=134,
                        num_blocks=2, num_slots=1)
    with pytest.raises(Unavailable, match="no free"):
        small.adopt(h)                                # 3 blocks needed, 2 in the pool
    assert ce.counters["handoffs_in"] == 0
    ce.check_integrity()
    ce.adopt(h)                                       # the intact one still goes through
    run_to_completion(ce)
