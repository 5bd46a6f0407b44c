"""kernels/cpu_indexer.pick_rows (kernels/cpu/indexer_topk.c) against the torch path
(ragged_indexer_scores + topk_indices + the gather of the picks) it replaces."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_indexer, cpu_ring
from kernels.indexer import topk_indices
from kernels.ragged import ragged_indexer_scores
from kernels.ring_rows import take_rows

pytestmark = pytest.mark.skipif(cpu_ring.library(torch.zeros(1), (torch.float32,)) is None,
                                reason="no compiled CPU library")


def torch_picks(q, w, table, flat, visible, k):
    keys = take_rows(table, flat)
    idx, ok = topk_indices(ragged_indexer_scores(q, w, keys), visible, k)
    return flat.gather(1, idx), ok


def case(t, kc, n, hi=2, di=32, seed=0, dup=False):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(n, di, generator=g)
    if dup:                      # repeated keys: exactly equal scores, ties by candidate index
        table[1::2] = table[0::2][: table[1::2].shape[0]]
    q = torch.randn(t, hi, di, generator=g)
    w = torch.randn(t, hi, generator=g)
    flat = torch.randint(0, n, (t, kc), generator=g)
    visible = torch.rand(t, kc, generator=g) < 0.7
    return q, w, table, flat, visible


@pytest.mark.parametrize("t,kc,k", [(1, 71, 16), (32, 71, 16), (9, 5, 16), (7, 16, 16),
                                    (33, 200, 64), (4, 1, 1)])
@pytest.mark.parametrize("dup", [False, True])
def test_picks_equal_the_torch_path(t, kc, k, dup):
    q, w, table, flat, visible = case(t, kc, 300, seed=t * 1000 + kc, dup=dup)
    got = cpu_indexer.pick_rows(q, w, table, flat, visible, k)
    assert got is not None
    want = torch_picks(q, w, table, flat, visible, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_relu_zeros_and_few_visible_rows():
    """Every score 0 (each head's dot product negative): all ties, so the lowest visible
    candidates; rows with fewer visible candidates than k pad with the lowest invisible ones;
    a row with none visible gets k invisible picks."""
    q, w, table, flat, visible = case(6, 40, 100, seed=5)
    q = -q.abs()
    table = table.abs()
    visible[0] = False
    visible[1] = torch.arange(40) % 9 == 0              # 5 visible
    got = cpu_indexer.pick_rows(q, w, table, flat, visible, 16)
    want = torch_picks(q, w, table, flat, visible, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not got[1][0].any() and int(got[1][1].sum()) == 5


def test_strided_table_and_torch_takes_the_rest(monkeypatch):
    q, w, table, flat, visible = case(8, 30, 50, seed=7)
    wide = torch.randn(50, 48)
    wide[:, 8:40] = table
    got = cpu_indexer.pick_rows(q, w, wide[:, 8:40], flat, visible, 8)   # rows 48 apart
    want = torch_picks(q, w, table, flat, visible, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cpu_indexer.pick_rows(q.double(), w.double(), table, flat, visible, 8) is None
    assert cpu_indexer.pick_rows(q, w, table, flat[:, :0], visible[:, :0], 8) is None
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert cpu_indexer.pick_rows(q, w, table, flat, visible, 8) is None
    monkeypatch.delenv("KVMESH_KERNELS")
    with pytest.raises(ValueError, match="do not fit"):
        cpu_indexer.pick_rows(q, w[:, :1], table, flat, visible, 8)


@pytest.mark.parametrize("di", [32, 128, 24])
@pytest.mark.parametrize("dup", [False, True])
def test_picks_of_works_equal_the_rows_own_lists(dup, di):
    """Rows naming their work's candidate list and a visible prefix pick exactly what they
    pick with the list copied per row and the prefix as a mask: every prefix from none
    (k invisible picks) through fewer than k (padding) to the whole list and past it; key
    widths scored 16 candidates at a time (32, 128) and one by one (24)."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(400, di, generator=g)
    if dup:
        table[1::2] = table[0::2]
    works = torch.randint(0, 400, (3, 90), generator=g)              # 3 works' lists of 90
    row_work = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0, 2, 1, 0])
    n_vis = torch.tensor([0, 5, 16, 17, 40, 89, 90, 91, 1, 63, 90])
    q = torch.randn(len(row_work), 2, di, generator=g)
    w = torch.randn(len(row_work), 2, generator=g)
    got = cpu_indexer.pick_rows_of_works(q, w, table, works, row_work, n_vis, 16)
    flat = works[row_work]
    visible = torch.arange(90).unsqueeze(0) < n_vis.unsqueeze(1)
    want = cpu_indexer.pick_rows(q, w, table, flat, visible, 16)
    assert got is not None and want is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch_rows, torch_ok = torch_picks(q, w, table, flat, visible, 16)
    assert torch.equal(got[0], torch_rows) and torch.equal(got[1], torch_ok)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_indexer.pick_rows_of_works(q, w, table, works, row_work[:-1], n_vis, 16)
