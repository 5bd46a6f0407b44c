"""DeepSeek V4.1 through the engine's two ledgers (v41_ledgers.py) against the whole-sequence
reference: chunked prefill, decodes, several sequences in one step, decoder-side truncation,
the encoder-side replay after a block hit, and rollback of rejected drafts. float64 with exact
rows: to 1e-9; float32 with MXFP8 rows: within a stated bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.model.deepseek_v4 import v41_layout
from services.engine.model.deepseek_v4.ledgers import rollback
from services.engine.model.deepseek_v4.v41_config import read_v41_config
from services.engine.model.deepseek_v4.v41_forward import V41Model
from services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, replay, step
from tests.engine.deepseek_v41 import tiny
from tests.engine.deepseek_v41.replay_reference import truncated_window_logits

EXACT = 1e-9
FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4.1-flash.json"


def _model(name, dtype=torch.float64):
    cfg = tiny.config(name)
    return V41Model(cfg, tiny.weights(cfg, dtype=dtype), dtype)


def _ledgers(m, slots=3, blocks=16):
    rows = "exact" if m.dtype == torch.float64 else "mxfp8"
    return V41Ledgers(m.cfg, slots, blocks, rows=rows, dtype=m.dtype)


def _prefill_then_decode(m, led, ids, chunk, decodes, cut=None, mode="compact"):
    seq, out, at = led.open(), [], 0
    prompt = len(ids) - decodes
    while at < prompt:
        size = min(chunk, prompt - at)
        out += step(m, led, [(seq, ids[at:at + size])], [cut], mode)
        at += size
    for _ in range(decodes):
        out += step(m, led, [(seq, ids[at:at + 1])], [cut], mode)
        at += 1
    return seq, torch.cat(out)


def test_the_flash_slot_is_laid_out_as_the_report_says():
    cfg = read_v41_config(FLASH, serving=False)
    led = V41Ledgers(cfg, 1, 1)
    rep = v41_layout.report(cfg)
    assert led.data.shape[1] == rep["state_slot"]["bytes"] == 2_928_384
    assert led.block_bytes() == rep["block"]["bytes"] == 819_200
    stored = [r for r in led.slot_layout.regions if r.name == "swa" and r.layer < 20]
    assert stored[-1].offset + stored[-1].nbytes == 1_415_040   # the stored region's prefix cut


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
@pytest.mark.parametrize("chunk", [1, 9, 1000])
def test_chunked_prefill_and_decodes_from_the_ledgers_compute_the_whole_sequence(name, chunk):
    m = _model(name)
    ids = tiny.prompt(name)
    _, got = _prefill_then_decode(m, _ledgers(m), ids, chunk, 5)
    assert (got - m.logits(ids)).abs().max() <= EXACT


def test_sequences_in_one_step_compute_what_each_computes_alone():
    name = "flash_geometry"
    m = _model(name)
    led = _ledgers(m)
    a, b = tiny.prompt(name, seed=2)[:150], tiny.prompt(name, seed=3)[:200]
    sa, sb = led.open(), led.open()
    step(m, led, [(sa, a[:140])])                                   # a has a prefix already
    la, lb = step(m, led, [(sa, a[140:141]), (sb, b[:199])])        # a decodes, b prefills
    (lb2,) = step(m, led, [(sb, b[199:])])
    (la2,) = step(m, led, [(sa, a[141:])])
    assert (torch.cat([la, la2]) - m.logits(a)[140:]).abs().max() <= EXACT
    assert (torch.cat([lb, lb2]) - m.logits(b)).abs().max() <= EXACT


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_truncated_prefill_from_the_ledgers_equals_the_truncated_reference(mode):
    name = "flash_geometry"
    m = _model(name)
    ids = tiny.prompt(name)
    decodes, keep = 4, m.cfg.window + 6
    cut = len(ids) - decodes - keep
    _, got = _prefill_then_decode(m, _ledgers(m), ids, 64, decodes, cut, mode)
    want = m.logits(ids, keep=len(ids) - cut)
    assert (got[-want.shape[0]:] - want).abs().max() <= EXACT


@pytest.mark.parametrize("name, hit", [("flash_like", 128), ("flash_geometry", 256)])
def test_replay_after_a_block_hit_equals_the_truncated_window_reference(name, hit):
    m = _model(name)
    led = _ledgers(m)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 100, (300,), generator=g).tolist()
    cold = led.open()
    step(m, led, [(cold, prompt)])
    warm = led.open()
    led.share(warm, cold.blocks[:hit // 128])
    got = replay(m, led, warm, prompt, hit)
    assert warm.length == len(prompt)
    assert (got - truncated_window_logits(m, prompt, hit)).abs().max() <= EXACT
    # the cached entries were read, not rewritten, and the sequence decodes on from there
    (after,) = step(m, led, [(warm, [7])])
    assert after.isfinite().all()


@pytest.mark.parametrize("name", ["flash_like", "yarn_hc4"])
def test_rollback_takes_back_drafts_through_both_layer_kinds(name):
    """Six draft tokens run and are rejected (window rows, ratio-2 tails, ratio-1 entries
    and keys all advanced); after the rollback the true tokens give the reference."""
    m = _model(name)
    led = _ledgers(m)
    ids = tiny.prompt(name)
    seq = led.open()
    step(m, led, [(seq, ids[:31])])
    step(m, led, [(seq, torch.tensor([3, 1, 4, 1, 5, 9]))])         # drafts, all rejected
    rollback(led, seq, 31)
    (got,) = step(m, led, [(seq, ids[31:])])
    assert (got - m.logits(ids)[31:]).abs().max() <= EXACT


def test_float32_with_mxfp8_rows_stays_within_its_bound():
    """The engine's default storage: window rows as MXFP8 (528 B at head_dim 512), tails and
    blocks fp32. Against the float32 reference the logits move by the rows' rounding only."""
    name = "flash_geometry"
    m = _model(name, torch.float32)
    ids = tiny.prompt(name)
    _, got = _prefill_then_decode(m, _ledgers(m), ids, 64, 4)
    want = m.logits(ids)
    err = (got - want).abs().max().item()
    assert err <= 2e-3, err          # 2.4e-4 measured
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
