"""Prefix hits on DeepSeek V4's ledgers: blocks shared (or installed from their bytes) plus
a window snapshot resume exactly where a cold run with the same chunks is."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import snapshots
from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, extend
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
SAME = 1e-12
P = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.stored_model("flash_geometry", tmp_path_factory.mktemp("flash_geometry"))


def _prompts():
    base = tiny.prompt("flash_geometry", seed=5).tolist()
    other = tiny.prompt("flash_geometry", seed=6).tolist()
    return base[:300], base[:P] + other[: 300 - P]      # same first 256 tokens, then apart


def _cold(model, prompt, decode=6):
    """prefill [0, P), then [P, len), then greedy decodes: rows from P on."""
    led = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    seq = led.open()
    extend(model, led, seq, prompt[:P])
    return _continue(model, led, seq, prompt, decode)


def _continue(model, led, seq, prompt, decode=6):
    rows = [extend(model, led, seq, prompt[P:])]
    for _ in range(decode):
        rows.append(extend(model, led, seq, [int(rows[-1][-1].argmax())]))
    return torch.cat(rows)


@pytest.mark.parametrize("past", [0, 5])
def test_hit_through_shared_blocks_and_snapshot_equals_cold(model, past):
    first, second = _prompts()
    led = Ledgers(model.cfg, num_slots=2, num_blocks=8)
    a = led.open()
    extend(model, led, a, first[:P])                 # the prefix in the cold run's chunk
    if past:                                         # a snapshot may lag its boundary by <= 5
        extend(model, led, a, first[P:P + past])
    snap = snapshots.take(led, a)
    assert snap.position == P
    b = led.open()
    led.share(b, a.blocks[: P // 128])
    snapshots.restore(led, b, snap)
    got = _continue(model, led, b, second)
    assert (got - _cold(model, second)).abs().max().item() <= SAME


def test_hit_from_another_engine_through_bytes_equals_cold(model):
    first, second = _prompts()
    here = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    a = here.open()
    extend(model, here, a, first[:P])
    snap, blocks = snapshots.take(here, a), snapshots.block_bytes(here, a.blocks[: P // 128])
    there = Ledgers(model.cfg, num_slots=1, num_blocks=4)   # a second engine: nothing shared
    b = there.open()
    snapshots.install_blocks(there, b, [bytes(x) for x in blocks])
    snapshots.restore(there, b, snapshots.Snapshot(snap.position, bytes(snap.rings),
                                                   bytes(snap.overlap)))
    got = _continue(model, there, b, second)
    assert (got - _cold(model, second)).abs().max().item() <= SAME


def test_snapshot_carries_rings_and_the_csa_overlap(model):
    led = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    seq = led.open()
    extend(model, led, seq, _prompts()[0][:P])
    snap = snapshots.take(led, seq)
    cfg = model.cfg
    assert len(snap.rings) == cfg.num_layers * 134 * 528
    assert len(snap.overlap) == snapshots.overlap_bytes(led) == (4 * 2 * (512 + 128) * 4
                                                                  * cfg.layer_kinds.count("csa"))
    from kvmesh.services.engine.model.deepseek_v4 import layout
    assert len(snap.rings) + len(snap.overlap) == \
        layout.report(cfg)["state_slot"]["snapshot_bytes"]


def test_no_snapshot_far_from_a_boundary(model):
    led = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    seq = led.open()
    extend(model, led, seq, _prompts()[0][:P + 7])
    with pytest.raises(ValueError, match="more than 6 tokens back"):
        snapshots.take(led, seq)


def test_hand_off_from_a_396_row_prefill_engine_decodes_as_a_unified_one(model):
    """A prefill engine with --extra-state rings (396 rows) prefills, hands the sequence to a
    decode engine (134 rows) by bytes, which decodes: the same as one engine doing both."""
    prompt = _prompts()[0]
    pe = Ledgers(model.cfg, num_slots=1, num_blocks=4, extra_state=True)
    assert pe.swa[0].shape[1] == 396
    a = pe.open()
    extend(model, pe, a, prompt[:P])
    last = extend(model, pe, a, prompt[P:])
    ce = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    b = snapshots.hand_off(pe, a, ce)
    rows, tok = [], int(last[-1].argmax())
    for _ in range(6):
        rows.append(extend(model, ce, b, [tok]))
        tok = int(rows[-1][-1].argmax())
    assert (torch.cat(rows) - _cold(model, prompt)[-6:]).abs().max().item() <= SAME


def test_a_396_row_engine_snapshot_restores_on_a_134_row_engine(model):
    first, second = _prompts()
    pe = Ledgers(model.cfg, num_slots=1, num_blocks=4, extra_state=True)
    a = pe.open()
    extend(model, pe, a, first[:P])
    snap = snapshots.take(pe, a)
    assert len(snap.rings) == model.cfg.num_layers * 134 * 528          # the inference layout
    ce = Ledgers(model.cfg, num_slots=1, num_blocks=4)
    b = ce.open()
    snapshots.install_blocks(ce, b, snapshots.block_bytes(pe, a.blocks[: P // 128]))
    snapshots.restore(ce, b, snap)
    assert (_continue(model, ce, b, second) - _cold(model, second)).abs().max().item() <= SAME


def test_a_damaged_block_is_refused_and_nothing_is_installed(model):
    led = Ledgers(model.cfg, num_slots=2, num_blocks=4)
    a = led.open()
    extend(model, led, a, _prompts()[0][:P])
    good = snapshots.block_bytes(led, a.blocks[: P // 128])
    bad = bytearray(good[1])
    bad[100] ^= 1
    b = led.open()
    free = led.pool.num_free
    with pytest.raises(ValueError, match="digest mismatch"):
        snapshots.install_blocks(led, b, [good[0], bytes(bad)])
    assert b.blocks == [] and led.pool.num_free == free
