"""Triton indexer scores (+ torch top-k) and gated pooling against the torch references."""

import pytest
import torch

from kernels import dispatch, indexer, pooling
from kernels.triton import indexer as tri_idx
from kernels.triton import pooling as tri_pool


def test_indexer_scores_close_and_topk_identical(device):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 5, 3, 32, generator=g)
    w = torch.randn(2, 5, 3, generator=g)
    k = torch.randn(2, 50, 32, generator=g)
    want = indexer.indexer_scores_torch(q, w, k)
    got = tri_idx.indexer_scores(q.to(device), w.to(device), k.to(device)).cpu()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    visible = torch.arange(50).view(1, 1, 50) < torch.tensor([[3, 10, 20, 40, 50]]).unsqueeze(2)
    for kk in (1, 4, 60):
        assert torch.equal(indexer.select_topk(got, visible, kk), indexer.select_topk(want, visible, kk))


def test_topk_ties_on_exact_scores(device):
    # small integers: every score is exact in any summation order, and ReLU and repeated
    # keys make many ties; the selection must be identical, lowest index first among ties
    g = torch.Generator().manual_seed(12)
    q = torch.randint(-2, 3, (1, 4, 2, 16), generator=g).float()
    w = torch.randint(0, 3, (1, 4, 2), generator=g).float()
    base = torch.randint(-1, 2, (4, 16), generator=g).float()
    k = base[torch.randint(0, 4, (30,), generator=g)].unsqueeze(0)          # 30 keys, 4 distinct
    want = indexer.indexer_scores_torch(q, w, k)
    got = tri_idx.indexer_scores(q.to(device), w.to(device), k.to(device)).cpu()
    assert torch.equal(got, want)
    visible = torch.arange(30).view(1, 1, 30) < torch.tensor([[0, 7, 19, 30]]).unsqueeze(2)
    for kk in (1, 3, 8):
        sel = indexer.select_topk(got, visible, kk)
        assert torch.equal(sel, indexer.select_topk(want, visible, kk))
        assert torch.equal(sel.sum(-1), torch.clamp(visible.sum(-1), max=kk))
    assert not indexer.select_topk(got, visible, 3)[0, 0].any()          # nothing visible yet


def test_indexer_no_entries(device):
    q, w = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3)
    got = tri_idx.indexer_scores(q.to(device), w.to(device), torch.zeros(1, 0, 32, device=device))
    assert got.shape == (1, 2, 0)


@pytest.mark.parametrize("m", [4, 5, 16])
def test_gated_pool(device, m):
    g = torch.Generator().manual_seed(13)
    v = torch.randn(3, m, 100, generator=g)
    z = torch.randn(3, m, 100, generator=g) * 5
    bias = torch.randn(m, 100, generator=g)
    want = pooling.gated_pool_torch(v, z, bias)
    got = tri_pool.gated_pool(v.to(device), z.to(device), bias.to(device)).cpu()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_dispatch_choices(monkeypatch):
    cpu = torch.zeros(1)
    assert not dispatch.use_triton(cpu)                         # auto: torch on CPU
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(cpu)
    assert not dispatch.use_triton(cpu.double())                # fp64 always takes torch
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert not dispatch.use_triton(cpu)
    monkeypatch.setenv("KVMESH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVMESH_KERNELS must be torch, triton or unset"):
        dispatch.use_triton(cpu)
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(cpu)
