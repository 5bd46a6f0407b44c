"""The 396 -> 134 handoff rearrangement (cache/handoff.py), byte-exact.

The reference is a 134-row ring written position by position the way a unified engine
writes it (row p % 134 holds p); the PE ring is written the same way with 396 (or 262)
rows, then rearranged. Every last write position 0..395 of the long ring is covered, and
the whole slot (both SWA groups rearranged, compression and indexer tails copied) is
compared with a 134-row slot written by the same positions.
"""

import pytest
import torch

from services.engine.cache.handoff import (
    handoff_block,
    handoff_state_bytes,
    rearrange_ring,
    rearrange_slot,
)
from services.engine.cache.layout import RuntimeLayout
from services.engine.config import TINY, V41_FLASH, EngineConfig

ROW = 528
MAX_END = 2 * 396 + 1


def _row_table(n: int) -> torch.Tensor:
    """A distinct 528-byte row per position (what position p writes into the ring)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (n, ROW), generator=g, dtype=torch.uint8)


def _written(rows: torch.Tensor, end: int, r: int) -> torch.Tensor:
    """A ring of r rows after positions 0..end-1 were written in order."""
    ring = torch.zeros(r, ROW, dtype=torch.uint8)
    for p in range(max(0, end - r), end):     # older writes are overwritten anyway
        ring[p % r] = rows[p]
    return ring


@pytest.mark.parametrize("r_src", [396, 262])
def test_rearranged_ring_equals_a_134_ring_for_every_write_position(r_src):
    rows = _row_table(MAX_END)
    seen = set()
    for end in range(0, MAX_END):
        got = rearrange_ring(_written(rows, end, r_src), end, 134)
        assert torch.equal(got, _written(rows, end, 134)), end
        if end:
            seen.add((end - 1) % r_src)
    assert seen == set(range(r_src))          # every ring write position of the long ring


def test_rearrange_refuses_a_shorter_source_ring():
    with pytest.raises(ValueError, match="cannot rearrange"):
        rearrange_ring(torch.zeros(10, ROW, dtype=torch.uint8), 5, 134)


def _layout(extra: bool, truncation: str = "compact") -> RuntimeLayout:
    keep = 134 if truncation != "off" else 0
    return RuntimeLayout.build(TINY, EngineConfig(num_slots=1, num_blocks=4, truncation=truncation,
                                                  keep_tokens=keep, extra_state=extra))


def _fill_slot(block, end: int, rows: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """A slot of `block` after `end` tokens: each SWA layer's ring written by positions
    (layer-dependent bytes), compression/indexer tails from `tails` (same in both modes)."""
    slot = torch.zeros(block.slot_bytes, dtype=torch.uint8)
    for r in block.regions():
        raw = slot[r.offset : r.offset + r.nbytes]
        if r.name == "swa":
            layer_rows = (rows.int() + r.layer * 31).remainder(256).to(torch.uint8)
            raw.copy_(_written(layer_rows, end, block.swa_ring).flatten())
        else:
            raw.copy_(tails[r.offset - block.stored_bytes - block.consumer_swa_bytes:][: r.nbytes])
    return slot


@pytest.mark.parametrize("truncation", ["compact", "off"])
def test_rearranged_slot_equals_a_unified_slot(truncation):
    pe = _layout(True, truncation).block
    ce = _layout(False, truncation).block
    assert pe.swa_ring == (396 if truncation != "off" else 262) and ce.swa_ring == 134
    assert handoff_block(pe) == ce
    rows = _row_table(MAX_END)
    g = torch.Generator().manual_seed(3)
    tails = torch.randint(0, 256, (pe.compression_bytes,), generator=g, dtype=torch.uint8)
    for end in (0, 1, 5, 133, 134, 135, 261, 262, 263, 300, 395, 396, 397, 530, 791, 792):
        got = rearrange_slot(pe, _fill_slot(pe, end, rows, tails), end)
        assert torch.equal(got, _fill_slot(ce, end, rows, tails)), end


def test_rearrange_slot_checks_its_input():
    pe = _layout(True).block
    with pytest.raises(ValueError, match="slot must be uint8"):
        rearrange_slot(pe, torch.zeros(pe.slot_bytes - 1, dtype=torch.uint8), 10)


# stored + consumer SWA at 134 rows + compression state, in bytes
#   tiny:      4 enc + 4 dec rings x 134 x 528 = 566,016; 3 CSA x (40,960 + 2,560) +
#              3 HCA x 548,864 = 1,777,152                              -> 2,343,168
#   v41-flash: 20 + 20 rings x 134 x 528 = 2,830,080; compression 11,401,216 -> 14,231,296
@pytest.mark.parametrize("cfg, swa, compression, total", [
    (TINY, 566_016, 1_777_152, 2_343_168),
    (V41_FLASH, 2_830_080, 11_401_216, 14_231_296),
])
def test_handoff_state_size_is_its_closed_form(cfg, swa, compression, total):
    pe = RuntimeLayout.build(cfg, EngineConfig(num_slots=1, num_blocks=1, truncation="compact",
                                               keep_tokens=134, extra_state=True)).block
    assert pe.swa_ring == 396
    assert handoff_state_bytes(pe) == total == swa + compression
    assert handoff_block(pe).slot_bytes == total
    assert pe.compression_bytes == compression
    if cfg is TINY:     # the function's output has that size too (v41-flash: too big to walk here)
        assert rearrange_slot(pe, torch.zeros(pe.slot_bytes, dtype=torch.uint8), 500).numel() == total
