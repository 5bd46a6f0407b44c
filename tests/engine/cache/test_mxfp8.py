"""MXFP8 SWA KV: byte layout and round-trip error bound."""

import torch

from kvmesh.kernels import mxfp8


def test_byte_layout_of_one_token():
    x = torch.zeros(512)
    x[0], x[1], x[32] = 1.0, -2.0, 448.0 * 4
    q = mxfp8.quantize(x)
    assert q.shape == (528,) and q.dtype == torch.uint8
    # block 0: amax 2 -> scale 2**ceil(log2(2/448)) = 2**-7 -> E8M0 byte 120
    assert q[512] == 127 - 7
    # block 1: amax 1792 -> scale 2**2 -> 129; 1792 / 4 = 448 = E4M3 0x7E
    assert q[513] == 129 and q[32] == 0x7E
    # 1.0 / 2**-7 = 128 = 2**7: E4M3 exponent field 7 + 7 = 14 -> 0x70; -256 -> sign | 15 << 3 = 0xF8
    assert q[0] == 0x70 and q[1] == 0xF8
    assert torch.equal(mxfp8.dequantize(q)[[0, 1, 32]], torch.tensor([1.0, -2.0, 1792.0]))
    # all-zero blocks decode to zeros
    assert torch.all(mxfp8.dequantize(q)[64:] == 0)


def test_round_trip_within_the_format_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.exp(torch.randn(64, 16, 1, generator=g) * 3).repeat(1, 1, 32).view(64, 512)
    q = mxfp8.quantize(x)
    assert q.shape == (64, 528)
    y = mxfp8.dequantize(q)
    scale = torch.exp2(q[:, 512:].float() - 127).repeat_interleave(32, dim=1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale
    err = (x - y).abs()
    assert torch.all(err <= bound * (1 + 1e-6)), float((err / bound).max())
    # and the bound is not vacuous: the worst case uses a good part of it
    assert float((err / bound).max()) > 0.5


def test_no_saturation_and_idempotent():
    x = torch.tensor([447.0, 449.0, 1e-3, -1e6] + [0.0] * 28)
    y = mxfp8.fake_quantize(x)
    assert torch.isfinite(y).all()
    assert torch.equal(mxfp8.fake_quantize(y), y)
