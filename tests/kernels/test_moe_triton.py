"""The grouped expert product in Triton against its torch reference (kernels/moe.py)."""

import pytest
import torch

from kvmesh.kernels import moe
from kvmesh.kernels.triton import moe as tri


@pytest.mark.parametrize("counts, k, m", [
    ([3, 0, 17, 1], 64, 48),       # an expert without rows, one with a single row
    ([40, 5], 40, 24),             # K and M not multiples of the tiles
    ([0, 0, 0], 32, 16),           # no rows at all
])
def test_grouped_linear_matches_torch(device, counts, k, m):
    torch.manual_seed(0)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], k, device=device)
    w = torch.randn(len(counts), m, k, device=device)
    want = moe.grouped_linear_torch(x, offsets, w)
    got = tri.grouped_linear(x, offsets, w)
    assert got.shape == want.shape == (offsets[-1], m)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dispatch_takes_triton_when_forced(device, monkeypatch):
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    x = torch.randn(5, 32, device=device)
    w = torch.randn(2, 16, 32, device=device)
    torch.testing.assert_close(moe.grouped_linear(x, [0, 2, 5], w),
                               moe.grouped_linear_torch(x, [0, 2, 5], w), rtol=1e-4, atol=1e-4)
    assert moe.grouped_linear(x.double(), [0, 2, 5], w.double()).dtype == torch.float64
