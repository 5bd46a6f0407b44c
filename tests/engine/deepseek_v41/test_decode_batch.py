"""Several sequences decoding in one step go through V4.1's attention together (v41_decode.py)
and read and write their rings together (v41_ledgers._read_rows / _write_rows). Each row must
compute what it computes alone: sequences of different lengths (no compressed entry yet, a
few, groups and candidate blocks closing mid-decode, windows not yet full and full), beside
a prefill chunk, and under decoder-side truncation, against the whole-sequence reference in
float64 (to 1e-9) and against one-at-a-time decoding in float32 with MXFP8 rows (bit for bit
is not promised: a batched matmul may sum in another order; the bound is asserted)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import v41_decode
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, step
from tests.engine.deepseek_v41 import tiny

EXACT = 1e-9
DECODES = 7


def _model(name, dtype=torch.float64):
    cfg = tiny.config(name)
    return V41Model(cfg, tiny.weights(cfg, dtype=dtype), dtype,
                    rows=None if dtype == torch.float64 else "mxfp8")


def _ledgers(m, slots=6):
    rows = "exact" if m.dtype == torch.float64 else "mxfp8"
    return V41Ledgers(m.cfg, slots, 32, rows=rows, dtype=m.dtype)


def _decode_together(m, led, prompts, cuts=None, prefill_beside=None):
    """Prefill each prompt alone, then decode DECODES tokens of every one in the same steps
    (with `prefill_beside`, a further prompt's chunks run in those steps too). Returns each
    prompt's decode logits [DECODES, vocab]."""
    cuts = cuts or [None] * len(prompts)
    seqs = [led.open() for _ in prompts]
    for seq, ids, cut in zip(seqs, prompts, cuts, strict=True):
        step(m, led, [(seq, ids[:-DECODES])], [cut])
    other = led.open() if prefill_beside is not None else None
    got = [[] for _ in prompts]
    for t in range(DECODES):
        works = [(seq, ids[len(ids) - DECODES + t:len(ids) - DECODES + t + 1])
                 for seq, ids in zip(seqs, prompts, strict=True)]
        step_cuts = list(cuts)
        if other is not None:
            works.append((other, prefill_beside[t * 5:(t + 1) * 5]))
            step_cuts.append(None)
        outs = step(m, led, works, step_cuts)
        for k in range(len(prompts)):
            got[k].append(outs[k])
    return [torch.cat(g) for g in got]


def _prompts(name, lengths):
    return [tiny.prompt(name, seed=10 + k)[:n] for k, n in enumerate(lengths)]


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_decode_rows_of_different_lengths_in_one_step_compute_the_whole_sequence(name, monkeypatch):
    calls = []
    real = v41_decode.decode_rows
    monkeypatch.setattr(v41_decode, "decode_rows", lambda *a: calls.append(1) or real(*a))
    m = _model(name)
    full = tiny.CONFIGS[name][1]
    prompts = _prompts(name, [DECODES + 1, DECODES + 4, full // 2 + 3, full])
    got = _decode_together(m, _ledgers(m), prompts,
                           prefill_beside=tiny.prompt(name, seed=30))
    assert calls, "the batched decode path did not run"
    for ids, logits in zip(prompts, got, strict=True):
        assert (logits - m.logits(ids)[-DECODES:]).abs().max() <= EXACT


def test_batched_decode_rows_under_truncation_equal_the_truncated_reference():
    name = "flash_geometry"
    m = _model(name)
    keep = m.cfg.window + 6
    prompts = _prompts(name, [200, 260, 300])
    cuts = [len(ids) - DECODES - keep for ids in prompts]
    got = _decode_together(m, _ledgers(m), prompts, cuts)
    for ids, cut, logits in zip(prompts, cuts, got, strict=True):
        want = m.logits(ids, keep=len(ids) - cut)
        assert (logits - want[-DECODES:]).abs().max() <= EXACT


def test_float32_mxfp8_rows_decoded_together_match_decoding_alone():
    name = "flash_geometry"
    m = _model(name, torch.float32)
    prompts = _prompts(name, [20, 150, 300])
    together = _decode_together(m, _ledgers(m), prompts)
    for ids, got in zip(prompts, together, strict=True):
        (alone,) = _decode_together(m, _ledgers(m), [ids])
        assert (got - alone).abs().max() <= 1e-4 * alone.abs().max()
        assert torch.equal(got.argmax(-1), alone.argmax(-1))


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_verify_spans_of_several_sequences_in_one_step_compute_the_whole_sequence(
        name, monkeypatch):
    """Verify spans (a token and 1-6 drafts) of sequences of different lengths attend
    together, beside a decode row and a prefill chunk; drafts that come true equal the
    reference, and after rolling the rest back the sequences go on exactly."""
    from kvmesh.services.engine.model.deepseek_v4.ledgers import rollback
    spans = []
    real = v41_decode.decode_rows
    monkeypatch.setattr(v41_decode, "decode_rows",
                        lambda *a: spans.append(a[-1]) or real(*a))
    m = _model(name)
    full = tiny.CONFIGS[name][1]
    prompts = _prompts(name, [9, full // 2 + 3, full - 8, full - 7])
    led = _ledgers(m)
    seqs = [led.open() for _ in prompts]
    ends = [len(ids) - 8 for ids in prompts]
    for seq, ids, end in zip(seqs, prompts, ends, strict=True):
        step(m, led, [(seq, ids[:end])])
    # true tokens, then wrong drafts after the first `good` of them
    good, sizes = [2, 0, 5, 0], [5, 3, 7, 1]
    works = []
    for seq, ids, end, g, n in zip(seqs, prompts, ends, good, sizes, strict=True):
        span = ids[end:end + n].clone()
        span[g + 1:] = (span[g + 1:] + 1) % 100
        works.append((seq, span))
    beside = led.open()
    works.append((beside, tiny.prompt(name, seed=30)[:6]))
    outs = step(m, led, works)
    assert any(lengths != [1] * len(lengths) for lengths in spans if lengths), \
        "verify spans did not attend together"
    for ids, end, g, out in zip(prompts, ends, good, outs[:-1], strict=True):
        assert (out[:g + 1] - m.logits(ids[:end + g + 1])[end:]).abs().max() <= EXACT
    for seq, end, g in zip(seqs, ends, good, strict=True):
        rollback(led, seq, end + g + 1)
    outs = step(m, led, [(seq, ids[end + g + 1:]) for seq, ids, end, g
                         in zip(seqs, prompts, ends, good, strict=True)])
    for ids, end, g, out in zip(prompts, ends, good, outs, strict=True):
        assert (out - m.logits(ids)[end + g + 1:]).abs().max() <= EXACT
