"""kernels/cpu_rows (kernels/cpu/norm_rope.c): RMS norm and the rotary embedding in one C
call each, against torch's ops (model/ops.py's torch path)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ring, cpu_rows
from services.engine.config import TINY
from services.engine.model import ops

pytestmark = pytest.mark.skipif(cpu_ring.library(torch.zeros(1), (torch.float32,)) is None,
                                reason="no compiled CPU library")


def _torch_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _torch_rope(x, cos, sin, rot):
    half = rot // 2
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    a, b = x[..., -rot:-half], x[..., -half:]
    return torch.cat([x[..., :-rot], a * cos - b * sin, a * sin + b * cos], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("d", [32, 100, 128, 512])
def test_norm_is_torchs_within_a_few_ulps(dtype, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, d, generator=g, dtype=dtype) * 3
    w = torch.randn(d, generator=g, dtype=dtype)
    got = cpu_rows.rms_norm(x, w, 1e-6)
    want = _torch_norm(x, w, 1e-6)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    ulps = ((got - want).abs() / want.abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
    assert ulps <= 4 * torch.finfo(dtype).eps, ulps / torch.finfo(dtype).eps


def test_norm_of_a_row_does_not_depend_on_the_others():
    """A speculative step's rows and a plain step's row must write the same cache bytes."""
    x, w = torch.randn(32, 128), torch.randn(128)
    batch = cpu_rows.rms_norm(x, w, 1e-6)
    for i in (0, 13, 31):
        assert torch.equal(cpu_rows.rms_norm(x[i : i + 1].clone(), w, 1e-6)[0], batch[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 2, 512), (32, 2, 512), (5, 512), (3, 4, 2, 128)])
def test_rope_is_torchs_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g, dtype=dtype)
    lead = shape[:-2] if len(shape) in (3, 4) else shape[:-1]
    pos = torch.randint(0, 100_000, lead, generator=g)
    cos, sin = ops.rope_angles(pos, TINY, dtype)
    want = _torch_rope(x, cos, sin, TINY.rope_dim)
    got = x.clone()
    assert cpu_rows.rope_(got, cos, sin, TINY.rope_dim)
    assert torch.equal(got, want)


def test_ops_take_the_c_calls_and_give_the_torch_path(monkeypatch):
    """model/ops.py's rms_norm and in-place rope through the C calls, and with
    KVMESH_KERNELS=torch through torch: the same numbers (the rope bit for bit)."""
    calls = []
    real_norm, real_rope = cpu_rows.rms_norm, cpu_rows.rope_
    monkeypatch.setattr(cpu_rows, "rms_norm", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(cpu_rows, "rope_", lambda *a: calls.append("rope") or real_rope(*a))
    x, w = torch.randn(9, 2, 512), torch.randn(512)
    pos = torch.arange(9) + 1000
    fast_n, fast_r = ops.rms_norm(x, w, 1e-6), ops.rope(x.clone(), pos, TINY, in_place=True)
    assert calls.count("norm") == 1 and calls.count("rope") == 1
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    plain_n, plain_r = ops.rms_norm(x, w, 1e-6), ops.rope(x.clone(), pos, TINY, in_place=True)
    assert torch.equal(fast_r, plain_r)
    assert torch.allclose(fast_n, plain_n, rtol=1e-6, atol=0)


def test_what_the_c_calls_leave_to_torch(monkeypatch):
    x, w = torch.randn(4, 128), torch.randn(128)
    cos, sin = ops.rope_angles(torch.arange(4), TINY, torch.float32)
    # autograd (training): torch's ops, which it can differentiate
    assert cpu_rows.rms_norm(x.clone().requires_grad_(), w, 1e-6) is None
    assert cpu_rows.rms_norm(x, w.clone().requires_grad_(), 1e-6) is None
    assert not cpu_rows.rope_(torch.randn(4, 512, requires_grad=True), cos, sin, 64)
    # layouts and dtypes it does not take
    assert cpu_rows.rms_norm(x.t(), torch.randn(4), 1e-6) is None          # not contiguous
    assert cpu_rows.rms_norm(x, w.double(), 1e-6) is None
    assert cpu_rows.rms_norm(x.half(), w.half(), 1e-6) is None
    assert cpu_rows.rms_norm(x, torch.randn(3), 1e-6) is None              # torch's error
    kv = torch.randn(4, 512)
    before = kv.clone()
    assert not cpu_rows.rope_(kv, cos[:3], sin[:3], 64)                    # rows disagree
    assert not cpu_rows.rope_(kv, cos, sin, 63)
    assert not cpu_rows.rope_(kv[:, ::2], cos, sin, 64)
    assert torch.equal(kv, before)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert cpu_rows.rms_norm(x, w, 1e-6) is None and not cpu_rows.rope_(kv, cos, sin, 64)
