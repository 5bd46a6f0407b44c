"""The DeepSeek V4 engine's Triton kernels at V4-Flash scale on a real GPU (compiled Triton vs
the torch reference on the same device). Skipped without CUDA; scripts/gpu_check.sh runs them."""

import pytest
import torch

from kvmesh.kernels import moe, mxfp8
from kvmesh.kernels.triton import moe as tri_moe
from kvmesh.kernels.triton import mxfp8 as tri_mx

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_mxfp8_bytes_at_scale():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 512, device="cuda", generator=g)
    x *= torch.exp(torch.randn(8192, 16, 1, device="cuda", generator=g) * 10).repeat(1, 1, 32).view(8192, 512)
    want = mxfp8.quantize_torch(x.cpu())
    assert torch.equal(tri_mx.quantize(x).cpu(), want)
    assert torch.equal(tri_mx.dequantize(want.cuda()).cpu(), mxfp8.dequantize_torch(want))


@pytest.mark.parametrize("rows", [8, 512])
def test_grouped_experts_at_v4_flash_width(rows):
    """16 of V4-Flash's routed experts (hidden 4096, expert width 2048), the rows spread
    unevenly over them (some experts get none)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    counts = torch.randint(0, 3 * rows // 16 + 1, (16,), generator=g, device="cuda").tolist()
    counts[3] = 0
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], 4096, device="cuda", generator=g)
    w = torch.randn(16, 2048, 4096, device="cuda", generator=g) * 0.02
    got = tri_moe.grouped_linear(x, offsets, w)
    want = moe.grouped_linear_torch(x, offsets, w)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
