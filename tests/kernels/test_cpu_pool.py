"""The compressor's group path in C (kernels/cpu_pool.py): the entries and indexer keys it
writes equal the torch path's (ops.pool_entries_at / ops.pool_index_keys over the stream of
fed and stored tail rows, then the scatter), float64 to the fp32 the store keeps, float32 within
a bound; it writes only the rows it is given; off the CPU path it steps aside."""

import pytest
import torch

from kernels import cpu_pool, cpu_ring
from kernels.ring_rows import RingAt
from services.engine.config import small_test_config
from services.engine.model import ops

pytestmark = pytest.mark.skipif(cpu_ring._compiler() is None,
                                reason="no C compiler: the compressor pools in torch")

CFG = small_test_config()
D = CFG.head_dim


def _case(dtype, m, groups, seed):
    """Fed rows, a strided fp32 tail ring with some stored rows, and a stream that mixes them."""
    g = torch.Generator().manual_seed(seed)
    n_fed, n_tail = groups * m - 3, 3
    v = torch.randn(n_fed, D, generator=g, dtype=dtype)
    z = torch.randn(n_fed, D, generator=g, dtype=dtype) * 2
    slab = torch.randn(6, 3 * (m + 4), 2, D, generator=g)          # a slot's slab is wider
    ring = slab[:, 2 : 2 + m + 4]                                   # [S, R, 2, D], strided
    tail_at = RingAt.of(torch.tensor([4, 1, 4]), torch.tensor([m + 1, 0, 3]), m + 4)
    pick = torch.randperm(n_fed + n_tail, generator=g)[: groups * m]
    pick[:n_tail] = torch.arange(n_fed, n_fed + n_tail)             # every tail row is used
    w = {"layers.0.cmp_bias": torch.randn(m, D, generator=g, dtype=dtype),
         "layers.0.cmp_norm": torch.rand(D, generator=g, dtype=dtype) + 0.5,
         "layers.0.idx_bias": torch.randn(m, D, generator=g, dtype=dtype)}
    gid = torch.tensor([5, 0, 9, 2, 7][:groups])
    return v, z, ring, tail_at, pick, w, gid


def _torch_entries(v, z, ring, tail_at, pick, w, gid, m, index):
    tail = ring[tail_at.slots, tail_at.rows].to(v.dtype)
    sv, sz = torch.cat([v, tail[:, 0]])[pick], torch.cat([z, tail[:, 1]])[pick]
    if index:
        return ops.pool_index_keys({"layers.0.idx_bias": w["layers.0.idx_bias"]}, 0, sv, sz, m).float()
    angles = ops.rope_angles(gid * m, CFG, v.dtype)
    return ops.pool_entries_at(w, 0, sv, sz, gid, m, CFG, angles).float()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m,groups", [(4, 3), (16, 2), (128, 1)])
@pytest.mark.parametrize("index", [False, True])
def test_entries_equal_the_torch_path(dtype, m, groups, index):
    v, z, ring, tail_at, pick, w, gid = _case(dtype, m, groups, seed=m + groups)
    table = torch.full((20, D), 7.0)
    rows = torch.tensor([11, 3, 17, 0, 5][:groups])
    before = table.clone()
    assert cpu_pool.pool_into(
        table, rows, v, z, ring, tail_at, pick, m,
        w["layers.0.idx_bias" if index else "layers.0.cmp_bias"],
        None if index else w["layers.0.cmp_norm"], CFG.norm_eps,
        None if index else ops.rope_angles(gid * m, CFG, dtype))
    want = _torch_entries(v, z, ring, tail_at, pick, w, gid, m, index)
    got = table[rows]
    if dtype == torch.float64:      # computed in float64, stored as fp32: one rounding apart at most
        assert ((got - want).abs() <= want.abs() * 2.0 ** -23).all()
    else:
        assert (got - want).abs().max() <= 2e-5 * want.abs().max()
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(table[untouched], before[untouched])


def test_the_fed_rows_in_order_need_no_pick():
    v, z, ring, _, _, w, gid = _case(torch.float64, 4, 3, seed=1)
    v, z = v[:12], z[:12]
    v, z = torch.cat([v, v[:3]]), torch.cat([z, z[:3]])             # 15 fed rows, 12 pooled
    table = torch.zeros(4, D)
    assert cpu_pool.pool_into(table, torch.tensor([2, 0, 3]), v, z, ring, None, None, 4,
                              w["layers.0.cmp_bias"], w["layers.0.cmp_norm"], CFG.norm_eps,
                              ops.rope_angles(gid * 4, CFG, torch.float64))
    want = ops.pool_entries_at(w, 0, v[:12], z[:12], gid, 4, CFG,
                               ops.rope_angles(gid * 4, CFG, torch.float64)).float()
    assert ((table[[2, 0, 3]] - want).abs() <= want.abs() * 2.0 ** -23).all()


def test_steps_aside_where_torch_must_do_it(monkeypatch):
    v, z, ring, tail_at, pick, w, gid = _case(torch.float32, 4, 3, seed=2)
    args = (torch.tensor([0, 1, 2]), v, z)
    rest = (tail_at, pick, 4, w["layers.0.idx_bias"])
    assert not cpu_pool.pool_into(torch.zeros(4, D), *args, ring.double(), *rest)   # not fp32 rows
    assert not cpu_pool.pool_into(torch.zeros(4, D), torch.tensor([0, 1, 2]), v.half(), z.half(),
                                  ring, *rest)
    assert not cpu_pool.pool_into(torch.zeros(4, D), *args, ring, tail_at, pick, cpu_pool.MAX_M + 1,
                                  torch.zeros(cpu_pool.MAX_M + 1, D))              # too long: torch
    monkeypatch.setattr(cpu_pool, "MAX_GROUPS", 2)                 # a prefill chunk's many groups
    assert not cpu_pool.pool_into(torch.zeros(4, D), *args, ring, *rest)
    monkeypatch.setattr(cpu_pool, "MAX_GROUPS", 32)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert not cpu_pool.pool_into(torch.zeros(4, D), *args, ring, *rest)


def test_the_limits_are_the_c_files():
    """pool_into refuses what the C buffers cannot hold before calling: the same numbers."""
    import re
    from pathlib import Path

    src = (Path(cpu_pool.__file__).with_name("cpu") / "pool_groups.c").read_text()
    limits = dict(re.findall(r"(MAX_POOL_D|MAX_M) = (\d+)", src))
    assert (int(limits["MAX_POOL_D"]), int(limits["MAX_M"])) == (cpu_pool.MAX_D, cpu_pool.MAX_M)
    assert cpu_pool.MAX_ROWS <= cpu_pool.MAX_M and cpu_pool.MAX_GROUPS > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_groups_split_over_threads_give_the_same_bits(dtype):
    """A call with many groups (sequences admitted together complete theirs on the same step)
    splits them over the threads: each group's entry is the same, bit for bit, on one thread
    and on two, and it equals the torch path's; stored tail rows are read in place."""
    m, groups, slots = 8, 16, 20
    g = torch.Generator().manual_seed(3)
    v = torch.randn(groups, D, generator=g, dtype=dtype)             # each group's newest row
    z = torch.randn(groups, D, generator=g, dtype=dtype) * 2
    ring = torch.randn(slots, m + 2, 2, D, generator=g)
    tail_at = RingAt.of(torch.arange(groups).repeat_interleave(m - 1),
                        torch.arange(m - 1).repeat(groups) + 1, m + 2)
    # group i: its m - 1 stored rows, then its fed row
    pick = torch.cat([torch.cat([groups + torch.arange(i * (m - 1), (i + 1) * (m - 1)),
                                 torch.tensor([i])]) for i in range(groups)])
    bias = torch.randn(m, D, generator=g, dtype=dtype)
    norm = torch.rand(D, generator=g, dtype=dtype) + 0.5
    gid = torch.arange(groups) * 3 + 1
    angles = ops.rope_angles(gid * m, CFG, dtype)
    rows = torch.randperm(40, generator=g)[:groups]
    assert groups * m * D >= 8192            # past MIN_PARALLEL_VALUES: two threads share it
    got = {}
    threads = torch.get_num_threads()
    for n in (1, 2):
        table = torch.zeros(40, D)
        torch.set_num_threads(n)
        try:
            assert cpu_pool.pool_into(table, rows, v, z, ring, tail_at, pick, m, bias, norm,
                                      CFG.norm_eps, angles)
        finally:
            torch.set_num_threads(threads)
        got[n] = table[rows]
    assert torch.equal(got[1], got[2])
    tail = ring[tail_at.slots, tail_at.rows].to(dtype)
    sv, sz = torch.cat([v, tail[:, 0]])[pick], torch.cat([z, tail[:, 1]])[pick]
    w = {"layers.0.cmp_bias": bias, "layers.0.cmp_norm": norm}
    want = ops.pool_entries_at(w, 0, sv, sz, gid, m, CFG, angles).float()
    assert (got[1] - want).abs().max() <= 2e-5 * want.abs().max()
