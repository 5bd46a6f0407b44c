"""DeepSeek V4.1 through the engine's two ledgers (v41_ledgers.py) against the whole-sequence
reference: chunked prefill, decodes, several sequences in one step, decoder-side truncation,
the encoder-side replay after a block hit, and rollback of rejected drafts. float64 with exact
rows: to 1e-9; float32 with MXFP8 rows: within a stated bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import v41_layout
from kvmesh.services.engine.model.deepseek_v4.ledgers import rollback
from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, replay, step
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
    cfg = read_v41_config(FLASH)
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
    served = V41Model(m.cfg, m.weights, torch.float32, rows="mxfp8")   # rounds as it stores
    ids = tiny.prompt(name)
    _, got = _prefill_then_decode(served, _ledgers(served), ids, 64, 4)
    want = m.logits(ids)
    err = (got - want).abs().max().item()
    assert err <= 2e-3, err          # 2.4e-4 measured
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _cold_with_snapshot(m, led, ids, at, cut):
    """Prefill ids in two chunks split at the snapshot position `at`; the snapshot and the
    logits of the prompt's rows past `at`."""
    from kvmesh.services.engine.model.deepseek_v4 import v41_snapshots
    seq = led.open()
    step(m, led, [(seq, ids[:at])], [cut])
    snap = v41_snapshots.take(led, seq)
    (rest,) = step(m, led, [(seq, ids[at:])], [cut])
    return seq, snap, rest


def test_a_snapshot_hit_under_truncation_resumes_exactly():
    """The snapshot holds the encoder rings only (the stored region); the decoder's are
    dropped. With the decoder cut at or past the snapshot, as truncation puts it on a hit
    capped 134 tokens before the prompt's end, a restored sequence computes what the cold
    run computed, row for row."""
    from kvmesh.services.engine.model.deepseek_v4 import v41_snapshots
    name = "flash_geometry"
    m = _model(name)
    led = _ledgers(m)
    ids = tiny.prompt(name)                      # 300 tokens
    cut = len(ids) - (m.cfg.window + 6)          # 166: the hit (128) is before it
    cold, snap, want = _cold_with_snapshot(m, led, ids, 128, cut)
    # encoder layers 0-1 (the decoder starts at the last KV source, 2): exact float64 rows
    assert len(snap.rings) == v41_snapshots.snapshot_bytes(led) == 2 * 134 * 32 * 8
    warm = led.open()
    led.share(warm, cold.blocks[:1])
    v41_snapshots.restore(led, warm, snap)
    (got,) = step(m, led, [(warm, ids[128:])], [cut])
    assert torch.equal(got, want)
    assert (got - m.logits(ids, keep=len(ids) - cut)).abs().max() <= EXACT


def test_a_snapshot_hit_without_truncation_runs_the_decoder_from_the_snapshot():
    from kvmesh.services.engine.model.deepseek_v4 import v41_snapshots
    name = "flash_geometry"
    m = _model(name)
    led = _ledgers(m)
    ids = tiny.prompt(name)
    cold, snap, _ = _cold_with_snapshot(m, led, ids, 256, None)
    warm = led.open()
    led.share(warm, cold.blocks[:2])
    v41_snapshots.restore(led, warm, snap)
    (got,) = step(m, led, [(warm, ids[256:])], [256])
    assert (got - m.logits(ids, keep=len(ids) - 256)).abs().max() <= EXACT


def test_a_handoff_from_a_396_row_prefill_engine_decodes_as_one_engine():
    from kvmesh.services.engine.model.deepseek_v4 import snapshots
    name = "flash_like"
    m = _model(name)
    prefill = V41Ledgers(m.cfg, 2, 8, extra_state=True, rows="exact", dtype=m.dtype)
    decode = _ledgers(m)
    ids = tiny.prompt(name)
    seq = prefill.open()
    step(m, prefill, [(seq, ids[:40])])
    state = snapshots.export_state(prefill, seq)
    assert snapshots.state_problem(decode, state) is None
    assert snapshots.state_problem(prefill, state) is not None     # 396-row rings refuse it
    moved = decode.open()
    snapshots.install_blocks(decode, moved, snapshots.block_bytes(prefill, seq.blocks))
    snapshots.adopt_state(decode, moved, state, seq.length)
    out = [step(m, decode, [(moved, ids[i:i + 1])])[0] for i in range(40, len(ids))]
    assert (torch.cat(out) - m.logits(ids)[40:]).abs().max() <= EXACT
    direct = snapshots.hand_off(prefill, seq, decode)
    (again,) = step(m, decode, [(direct, ids[40:])])
    assert (again - m.logits(ids)[40:]).abs().max() <= EXACT
