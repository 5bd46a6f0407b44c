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


def test_engine_on_cuda_triton_path_matches_torch_path(monkeypatch):
    """The engine placed on CUDA in fp32, once with the kernels dispatch picks there (Triton)
    and once with KVMESH_KERNELS=torch: a 300-token cold request, then one with a block-cache
    hit and a bounded replay (tests/kernels/engine_tokens.py's case). Same greedy tokens,
    logits within 1e-3 of their magnitude, and the Triton ragged kernels really ran."""
    from kernels.triton import ragged as tri
    from services.engine.config import small_test_config
    from services.engine.core.sampling import SamplingParams
    from services.engine.model import weights as weights_mod
    from tests.engine.helpers import make_engine, random_prompt, run_to_completion

    cfg = small_test_config()
    w = weights_mod.init_weights(cfg, 0, torch.float32)
    first = random_prompt(300, 21)
    shared = (300 // 2 // cfg.block_size) * cfg.block_size
    second = first[:shared] + random_prompt(300 - shared, 22)
    calls = []
    kernel = tri.union_attention
    monkeypatch.setattr(tri, "union_attention", lambda *a: calls.append(1) or kernel(*a))
    runs = {}
    for kernels in ("torch", "auto"):
        monkeypatch.setenv("KVMESH_KERNELS", kernels)
        engine = make_engine(cfg, dtype="float32", weights=w, device="cuda",
                             truncation="compact", keep_tokens=22, swa_policy="zero",
                             max_batched_tokens=128)
        out = []
        for prompt in (first, second):
            seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6))
            run_to_completion(engine, check=False)
            out.append((seq.output, torch.stack(engine.logits[seq.request_id]).cpu(),
                        seq.cached_tokens, seq.replayed_tokens))
        runs[kernels] = out
        assert bool(calls) == (kernels == "auto")
    assert runs["auto"][1][2] > 0 and runs["auto"][1][3] > 0        # a hit and a replay
    for (tok_t, log_t, *_), (tok_x, log_x, *_) in zip(runs["torch"], runs["auto"], strict=True):
        assert tok_t == tok_x
        assert float((log_t - log_x).abs().max()) <= 1e-3 * float(log_t.abs().max())
