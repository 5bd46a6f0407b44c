"""The compiled CPU ring-attention kernel (kernels/cpu/ring_attention.c) computes the union
attention of the plain math: it reads MXFP8 ring bytes, so its values are the exact
dequantized rows, and its output and log-sum-exp match a float64 reference over those rows
(float64 to 1e-12, float32 within an asserted bound); joined with the other key groups and
the sink (kernels/ragged.py) it equals the flash path and the plain math."""

import os

import pytest
import torch

from kernels import cpu_ring, mxfp8, ragged
from kernels.attention import union_attention
from kernels.ragged import RingKeys, SlotRows, ragged_union_attention

needs_cc = pytest.mark.skipif(
    cpu_ring._compiler() is None, reason="no C compiler on this machine: the kernel is not built "
    "and the engine takes the torch path (covered by tests/engine/model/test_ring_passes.py)")

S, R, D, H = 10, 11, 64, 3
F32_BOUND = 2e-6      # of the output's largest magnitude: fp32 sums in another order


def _ring(seed, subnormals=False):
    """MXFP8 ring bytes [S, R, D + D/32] and their exact values. With `subnormals` every block
    mixes values 2^12 apart, so E4M3 subnormal codes occur (the kernel's other branch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, R, D, generator=g, dtype=torch.float64)
    if subnormals:
        x[..., ::3] *= 2.0 ** -12
    x *= 2.0 ** torch.randint(-20, 20, (S, R, 1), generator=g)   # a spread of block scales
    codes = mxfp8.quantize_torch(x.float())
    return codes, mxfp8.dequantize_torch(codes, torch.float64)


def _reference(q, values, row_slots, ok, scale):
    """Per row over its slot's seen ring rows, float64: (out [T, H, D], lse [T, H])."""
    s = torch.einsum("thd,trd->thr", q.double(), values[row_slots]) * scale
    s = s.masked_fill(~ok.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("thr,trd->thd", p, values[row_slots]), lse


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("row_slots", [[0, 1, 2, 3, 4], [7, 2, 9, 0, 4], [3, 3, 8, 1, 1, 1, 6]])
@pytest.mark.parametrize("subnormals", [False, True])
def test_kernel_equals_float64_reference(row_slots, dtype, subnormals):
    codes, values = _ring(len(row_slots), subnormals)
    if subnormals:       # the case is real: some codes are E4M3 subnormals (exponent 0, m > 0)
        c = codes[..., :D]
        assert ((c & 0x78) == 0).logical_and((c & 7) > 0).sum() > 100
    g = torch.Generator().manual_seed(5)
    t = len(row_slots)
    q = torch.randn(t, H, D, generator=g, dtype=dtype)
    ok = torch.rand(t, R, generator=g) < 0.7
    ok[1] = False                                   # a row that sees nothing
    slots = torch.tensor(row_slots)
    got, lse = cpu_ring.ring_attention(q, codes, slots, ok, 0.125)
    want, want_lse = _reference(q, values, slots, ok, 0.125)
    assert torch.equal(lse[1], torch.full((H,), float("-inf"), dtype=dtype))
    assert torch.equal(got[1], torch.zeros(H, D, dtype=dtype))
    seen = ok.any(-1)
    if dtype == torch.float64:
        assert (got.double() - want).abs().max() <= 1e-12 * want.abs().max()
        assert ((lse[seen] - want_lse[seen]).abs() / want_lse[seen].abs().clamp(min=1)).max() <= 1e-12
    else:
        assert (got.double() - want).abs().max() <= F32_BOUND * want.abs().max()
        assert ((lse[seen].double() - want_lse[seen]).abs()
                / want_lse[seen].abs().clamp(min=1)).max() <= F32_BOUND


@needs_cc
def test_threads_split_rows_alike():
    """Rows are split over threads: 1, 2 and 5 threads give the same bits."""
    codes, _ = _ring(3)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(9, H, D, generator=g)
    ok = torch.rand(9, R, generator=g) < 0.8
    slots = torch.randint(0, S, (9,), generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            outs.append(cpu_ring.ring_attention(q, codes, slots, ok, 0.1))
    finally:
        torch.set_num_threads(before)
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


@needs_cc
def test_strided_slot_view():
    """The engine's rings are views into a larger per-slot state (a slot stride beyond R rows)."""
    codes, values = _ring(4)
    wide = torch.zeros(S, R + 3, D + D // 32, dtype=torch.uint8)
    wide[:, 2 : 2 + R] = codes
    view = wide[:, 2 : 2 + R]
    assert not view.is_contiguous()
    q = torch.randn(4, H, D, dtype=torch.float64)
    ok = torch.ones(4, R, dtype=torch.bool)
    slots = torch.tensor([9, 0, 5, 5])
    got, _ = cpu_ring.ring_attention(q, view, slots, ok, 0.2)
    want, _ = _reference(q, values, slots, ok, 0.2)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


@needs_cc
def test_bad_codes_shape_is_refused():
    q = torch.randn(2, H, D)
    with pytest.raises(ValueError, match="uint8"):
        cpu_ring.ring_attention(q, torch.zeros(S, R, D, dtype=torch.uint8), torch.tensor([0, 1]),
                                torch.ones(2, R, dtype=torch.bool), 0.1)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_joined_groups_equal_flash_and_plain(dtype, monkeypatch):
    """Through ragged_union_attention with a per-row group and a shared pool beside the ring:
    the C path = the flash path (KVMESH_KERNELS=torch) = the plain math, and = the batched
    union attention per row."""
    codes, values = _ring(6)
    g = torch.Generator().manual_seed(6)
    row_slots = [4, 4, 0, 9, 2, 2, 2]
    t = len(row_slots)
    q = torch.randn(t, H, D, generator=g, dtype=dtype)
    ok = torch.rand(t, R, generator=g) < 0.8
    ok[0] = False                                   # sees only the other groups and the sink
    ring = RingKeys(values.to(dtype), SlotRows.build(row_slots), ok, codes)
    per_row = (torch.randn(t, 5, D, generator=g, dtype=dtype), torch.rand(t, 5, generator=g) < 0.7)
    shared = (torch.randn(4, D, generator=g, dtype=dtype), torch.rand(t, 4, generator=g) < 0.5)
    sink = torch.randn(H, generator=g, dtype=dtype)
    groups = [ring, per_row, shared]
    assert cpu_ring.available(q)
    got = ragged_union_attention(q, groups, sink, 0.125)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert not cpu_ring.available(q)
    flash = ragged_union_attention(q, groups, sink, 0.125)
    plain = ragged._union(q, groups, sink, 0.125)
    allok = torch.cat([ok, per_row[1], shared[1]], 1)
    want = torch.stack([union_attention(
        q[None, i : i + 1].double(),
        [(torch.cat([values[s], per_row[0][i].double(), shared[0].double()])[None], allok[None, i : i + 1])],
        sink.double(), 0.125)[0, 0] for i, s in enumerate(row_slots)])
    bound = (1e-12 if dtype == torch.float64 else F32_BOUND) * want.abs().max()
    for other in (flash, plain, want):
        assert (got.double() - other.double()).abs().max() <= bound


@needs_cc
def test_slot_outside_the_ring_is_refused():
    codes, values = _ring(2)
    ok = torch.ones(1, R, dtype=torch.bool)
    ring = RingKeys(values, SlotRows.build([S]), ok, codes)
    with pytest.raises(IndexError, match="outside"):
        ragged_union_attention(torch.randn(1, H, D, dtype=torch.float64), [ring], torch.zeros(H), 0.1)


def test_a_failed_build_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    """A compiler that fails (or none): available() is False, the reason is logged once, and
    the ring group takes the flash path with the same result."""
    codes, values = _ring(7)
    q = torch.randn(3, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ok = torch.ones(3, R, dtype=torch.bool)
    groups = [RingKeys(values, SlotRows.build([1, 4, 4]), ok, codes)]
    sink = torch.zeros(H, dtype=torch.float64)
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ring, "_compiler", lambda: "/bin/false")
    monkeypatch.setattr(cpu_ring, "_tried", False)
    monkeypatch.setattr(cpu_ring, "_lib", None)
    with caplog.at_level("WARNING"):
        assert not cpu_ring.available(q)
        assert not cpu_ring.available(q)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "did not build" in caplog.records[0].message
    got = ragged_union_attention(q, groups, sink, 0.1)
    want = ragged._union(q, groups, sink, 0.1)
    # relative: the ring's values span 2^-20..2^20 (outputs up to ~1e6), so float64 sums in
    # another order differ by ~1e-12 absolute (q once came from the global generator, and a
    # draw that reached 3.6e-12 failed an absolute 1e-12 bound)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("groups", ["ring+table", "table", "table+table2", "ring+table+table2"])
def test_table_rows_read_in_place(dtype, groups):
    """A decode row's compressed entries: fp32 table rows named per row by index (repeats and
    masked picks included), in one softmax with the ring; = the float64 reference over the
    row's ring rows and its gathered table rows. With a second table (a prefill chunk's window
    keys by index beside its entries) its rows join the same softmax, after the first's."""
    codes, values = _ring(8)
    g = torch.Generator().manual_seed(8)
    row_slots = [2, 2, 7, 0, 5]
    t, n, k = len(row_slots), 30, 9
    table = torch.randn(n, D, generator=g)                       # fp32, as the block store
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[0, 1] = idx[0, 0]                                         # a repeated pick counts twice
    tok = torch.rand(t, k, generator=g) < 0.6
    tok[2] = False                                                # a row with no entries
    ok = torch.rand(t, R, generator=g) < 0.7
    ok[3] = False                                                 # a row with no ring keys
    q = torch.randn(t, H, D, generator=g, dtype=dtype)
    ring = (codes, torch.tensor(row_slots), ok) if groups.startswith("ring") else None
    second = None
    if groups.endswith("table2"):
        rows2 = torch.randn(17, D, generator=g) * 2
        idx2 = torch.randint(0, 17, (t, 5), generator=g)
        ok2 = torch.rand(t, 5, generator=g) < 0.5
        ok2[2] = False                                            # row 2 still sees nothing there
        second = (rows2, idx2, ok2)
    got, lse = cpu_ring.union_attention(q, 0.125, ring=ring, table=(table, idx, tok), table2=second)
    keys, seen = table.double()[idx], tok
    if second is not None:
        keys = torch.cat([keys, rows2.double()[idx2]], 1)
        seen = torch.cat([seen, ok2], 1)
    if ring is not None:
        keys = torch.cat([values[row_slots], keys], 1)
        seen = torch.cat([ok, seen], 1)
    s = torch.einsum("thd,tkd->thk", q.double(), keys) * 0.125
    s = s.masked_fill(~seen.unsqueeze(1), float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want = torch.einsum("thk,tkd->thd", torch.exp(s - want_lse.unsqueeze(-1)).nan_to_num(0.0), keys)
    bound = 1e-12 if dtype == torch.float64 else F32_BOUND
    assert (got.double() - want).abs().max() <= bound * want.abs().max()
    live = seen.any(-1)
    assert ((lse[live].double() - want_lse[live]).abs() / want_lse[live].abs().clamp(min=1)).max() <= bound
    if ring is None:
        assert torch.equal(got[2], torch.zeros(H, D, dtype=dtype))
        assert torch.isinf(lse[2]).all()


@needs_cc
def test_table_keys_through_ragged_equal_the_gathered_path(monkeypatch):
    """ragged_union_attention with [RingKeys, TableKeys] (what the engine passes for decode
    rows of CSA/HCA layers): the kernel = the flash path over the gathered entries."""
    codes, values = _ring(9)
    g = torch.Generator().manual_seed(9)
    row_slots = [1, 6, 6, 3]
    t = len(row_slots)
    q = torch.randn(t, H, D, generator=g, dtype=torch.float64)
    ok = torch.rand(t, R, generator=g) < 0.8
    table = torch.randn(20, D, generator=g)
    keys = ragged.TableKeys(table, torch.randint(0, 20, (t, 6), generator=g),
                            torch.rand(t, 6, generator=g) < 0.7)
    groups = [RingKeys(values, SlotRows.build(row_slots), ok, codes), keys]
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    got = ragged_union_attention(q, groups, sink, 0.125)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    want = ragged_union_attention(q, groups, sink, 0.125)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_cache_dir_falls_back_to_temp_when_home_is_read_only(monkeypatch, tmp_path):
    monkeypatch.delenv("KVMESH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ring.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert cpu_ring.cache_dir() == tmp_path / "cache" / "kvmesh"        # writable: used
    # a cache directory this user may not write (root may write anything, so the check
    # is what is replaced, not the permissions)
    monkeypatch.setattr(cpu_ring.os, "access", lambda path, mode: False)
    assert cpu_ring.cache_dir() == tmp_path / "tmp" / f"kvmesh-{os.getuid()}"
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu_ring.cache_dir() == tmp_path / "mine"


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sink_is_one_more_softmax_column(dtype):
    """With the sink the kernel's output is the whole attention (a per-head logit of value 0
    in the same softmax) and lse counts it; a row that sees nothing gets 0 and lse = sink."""
    codes, values = _ring(11)
    g = torch.Generator().manual_seed(11)
    row_slots = [4, 0, 9, 2]
    q = torch.randn(len(row_slots), H, D, generator=g, dtype=dtype) * 3
    ok = torch.rand(len(row_slots), R, generator=g) < 0.7
    ok[2] = False
    sink = torch.tensor([-1.0, 0.5, 40.0], dtype=dtype)
    got, lse = cpu_ring.union_attention(q, 0.125, ring=(codes, torch.tensor(row_slots), ok), sink=sink)
    s = torch.einsum("thd,trd->thr", q.double(), values[row_slots]) * 0.125
    s = s.masked_fill(~ok.unsqueeze(1), float("-inf"))
    s = torch.cat([s, sink.double().view(1, H, 1).expand(len(row_slots), H, 1)], -1)
    want_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - want_lse.unsqueeze(-1))[..., :-1]
    want = torch.einsum("thr,trd->thd", p, values[row_slots])
    bound = 1e-12 if dtype == torch.float64 else F32_BOUND
    assert (got.double() - want).abs().max() <= bound * want.abs().max()
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp(min=1)).max() <= bound
    assert torch.equal(got[2], torch.zeros(H, D, dtype=dtype))
    assert torch.equal(lse[2], sink)
    plain, _ = cpu_ring.union_attention(q, 0.125, ring=(codes, torch.tensor(row_slots), ok))
    assert not torch.allclose(plain, got)                  # the sink took weight: a real case


@needs_cc
@pytest.mark.parametrize("d", [32, 96])
def test_head_sizes_past_whole_column_tiles(d):
    """The sums go four 16-column vectors at a time; a head size that leaves two over
    (d = 32, 96) takes the remainder loop and still matches the reference."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(S, R, d, generator=g, dtype=torch.float64)
    codes = mxfp8.quantize_torch(x.float())
    values = mxfp8.dequantize_torch(codes, torch.float64)
    row_slots = [1, 5, 5, 8]
    q = torch.randn(len(row_slots), H, d, generator=g, dtype=torch.float32)
    ok = torch.rand(len(row_slots), R, generator=g) < 0.8
    got, lse = cpu_ring.ring_attention(q, codes, torch.tensor(row_slots), ok, 0.2)
    want, want_lse = _reference(q, values, row_slots, ok, 0.2)
    assert (got.double() - want).abs().max() <= F32_BOUND * want.abs().max()
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp(min=1)).max() <= F32_BOUND


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", [256, 288])
def test_block_factors_eight_at_a_time_and_past_e134(dtype, d):
    """Rows of 8 and 9 scale blocks (the AVX2 widening makes a row's factors 8 blocks at a
    time, then one by one), each block scaled by up to 2^19, so that some rows hold a scale
    byte past 134 (their own path: two factors a value), with d = 288 some only in the last
    block. Every row equals the reference."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(S, R, d // 32, 32, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-20, 20, (S, R, d // 32, 1), generator=g)
    codes = mxfp8.quantize_torch(x.view(S, R, d).float())
    values = mxfp8.dequantize_torch(codes, torch.float64)
    row_slots = [0, 3, 3, 7, 9]
    big = codes[row_slots][..., d:] > 134
    assert big.any(-1).any() and (~big.any(-1)).any()       # both kinds of rows are read
    if d == 288:                                            # and rows big in the tail only
        assert (big[..., 8] & ~big[..., :8].any(-1)).any()
    q = torch.randn(len(row_slots), H, d, generator=g, dtype=dtype)
    ok = torch.ones(len(row_slots), R, dtype=torch.bool)
    got, lse = cpu_ring.ring_attention(q, codes, torch.tensor(row_slots), ok, 0.01)
    want, want_lse = _reference(q, values, row_slots, ok, 0.01)
    bound = 1e-12 if dtype == torch.float64 else F32_BOUND
    assert (got.double() - want).abs().max() <= bound * want.abs().max()
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp(min=1)).max() <= bound
