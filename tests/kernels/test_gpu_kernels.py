"""Kernels at v41-flash geometry on a real GPU (compiled Triton vs the torch reference on
the same device). Skipped without CUDA; scripts/gpu_check.sh runs them."""

import pytest
import torch

from kernels import attention, indexer, mxfp8
from kernels.triton import attention as tri_att
from kernels.triton import indexer as tri_idx
from kernels.triton import mxfp8 as tri_mx

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_mxfp8_bytes_at_scale():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 512, device="cuda", generator=g)
    x *= torch.exp(torch.randn(8192, 16, 1, device="cuda", generator=g) * 10).repeat(1, 1, 32).view(8192, 512)
    want = mxfp8.quantize_torch(x.cpu())
    assert torch.equal(tri_mx.quantize(x).cpu(), want)
    assert torch.equal(tri_mx.dequantize(want.cuda()).cpu(), mxfp8.dequantize_torch(want))


@pytest.mark.parametrize("batch", [1, 32])
def test_swa_decode_v41_geometry(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    h, d, w, r = 64, 512, 128, 134
    ring = mxfp8.quantize_torch(torch.randn(batch, r, d, device="cuda", generator=g))
    chunk = mxfp8.quantize_torch(torch.randn(batch, 1, d, device="cuda", generator=g))
    q = torch.randn(batch, 1, h, d, device="cuda", generator=g)
    pos = torch.randint(0, 5000, (batch, 1), device="cuda", generator=g)
    keys = torch.randn(batch, 600, d, device="cuda", generator=g)
    idx = torch.randint(0, 600, (batch, 1, 512), device="cuda", generator=g)
    ok = torch.rand(batch, 1, 512, device="cuda", generator=g) > 0.1
    args = (q, ring, torch.arange(batch, device="cuda"), chunk, pos,
            torch.ones(batch, 1, dtype=torch.bool, device="cuda"),
            torch.zeros(batch, dtype=torch.long, device="cuda"), w,
            torch.randn(h, device="cuda", generator=g), d ** -0.5, (keys, ok, idx))
    want = attention.ring_attention_torch(*args)
    got = tri_att.ring_attention(*args)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


def test_indexer_v41_geometry():
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(4, 1, 64, 128, device="cuda", generator=g)
    w = torch.randn(4, 1, 64, device="cuda", generator=g)
    k = torch.randn(4, 8192, 128, device="cuda", generator=g)
    want = indexer.indexer_scores_torch(q, w, k)
    got = tri_idx.indexer_scores(q, w, k)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("batch", [1, 64])
def test_ragged_decode_v41_geometry(batch, monkeypatch):
    """The engine's attention op: decode rows reading the MXFP8 ring in place (134 rows,
    window 128 visible) plus 512 CSA picks per row, Triton vs the torch ragged op."""
    from kernels import ragged
    from kernels.triton import ragged as tri

    g = torch.Generator(device="cuda").manual_seed(batch)
    h, d, w, r = 64, 512, 128, 134
    codes = mxfp8.quantize_torch(torch.randn(batch, r, d, device="cuda", generator=g))
    rows = ragged.SlotRows.build(list(range(batch)), "cuda")
    ok = torch.ones(batch, r, dtype=torch.bool, device="cuda")
    ok[:, w:] = False                                  # rows outside the window
    ring = ragged.RingKeys(mxfp8.dequantize_torch(codes), rows, ok, codes)
    picks = torch.randn(batch, 512, d, device="cuda", generator=g)
    pick_ok = torch.rand(batch, 512, device="cuda", generator=g) > 0.1
    q = torch.randn(batch, h, d, device="cuda", generator=g)
    sink = torch.randn(h, device="cuda", generator=g)
    groups = [ring, (picks, pick_ok)]
    got = tri.union_attention(q, groups, sink, d ** -0.5)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")          # the reference, on the same GPU
    want = ragged.ragged_union_attention(q, groups, sink, d ** -0.5)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
