"""MXFP8 quantization in C (kernels/cpu/mxfp8.c through mxfp8.quantize_values): the same
bytes and values as the torch path bit for bit, over block scales from 2^-126 to 2^126, E4M3
subnormals, exact rounding ties, zeros of both signs and blocks of nothing but zeros."""

import pytest
import torch

from kvmesh.kernels import cpu_library, mxfp8

pytestmark = pytest.mark.skipif(cpu_library._compiler() is None,
                                reason="no C compiler: MXFP8 quantization runs in torch")


def _torch(x, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("KVMESH_KERNELS", "torch")
        assert mxfp8._quantize_values_c(x) is None              # the torch path, for sure
        return mxfp8.quantize_values(x)


def _rows(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, 32, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-126, 120, (40, 8, 1), generator=g)      # a scale per block
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[0, 2, ::2] = 0.0
    x[1, 0] = 2.0 ** -140                                               # amax under 2^-120
    x[1, 1, :16] *= 2.0 ** -10                                          # E4M3 subnormals
    # exact ties: halfway between neighbouring E4M3 values (448 sets the block's scale to 1)
    table = mxfp8.e4m3_table("cpu")[:127].double()
    mids = (table[:-1] + table[1:]) / 2
    x[2, :, 0] = 448.0
    x[2, :, 1:] = mids[torch.randint(0, len(mids), (8, 31), generator=g)]
    x[3] = -x[2]
    return x.reshape(40, 256).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bytes_and_values_equal_the_torch_path(dtype, monkeypatch):
    x = _rows(dtype)
    assert mxfp8._quantize_values_c(x) is not None            # the C path runs here
    got_q, got_v = mxfp8.quantize_values(x)
    want_q, want_v = _torch(x, monkeypatch)
    assert got_q.dtype == torch.uint8 and got_v.dtype == dtype
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_v, want_v)
    assert torch.equal(got_q, mxfp8.quantize_torch(x))
    # and the cases are real: ties, subnormal codes, the smallest scale byte
    codes = got_q[:, :256]
    assert ((codes & 0x78) == 0).logical_and((codes & 7) > 0).any()
    assert (got_q[:, 256:] == 0).any()


def test_leading_dims_and_a_strided_input_keep_their_shape(monkeypatch):
    x = _rows(torch.float32).view(5, 8, 256)[:, ::2]
    got_q, got_v = mxfp8.quantize_values(x)
    want_q, want_v = _torch(x, monkeypatch)
    assert got_q.shape == (5, 4, 264) and torch.equal(got_q, want_q) and torch.equal(got_v, want_v)
