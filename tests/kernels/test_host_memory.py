"""kernels/host_memory.py: large CPU tensors on 2 MB pages (the block ledger's tensors)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from kvmesh.kernels import host_memory

MB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_on = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                            reason="transparent huge pages are off on this machine")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
def test_zeros_is_torch_zeros(dtype):
    t = host_memory.zeros((3, MB), dtype)
    assert t.shape == (3, MB) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not t.any()
    t[2, -1] = 7                            # writable to its last element
    assert t.sum().item() == 7


@thp_on
def test_a_large_tensor_is_on_huge_pages_from_the_start():
    t = host_memory.zeros((8 * MB,), torch.uint8)
    # mapped before its first use: a first touch in a decode step could wait for the kernel
    # to compact memory (a 25-34 ms step where 5 ms was usual)
    assert host_memory.huge_pages_of(t) >= 6 * MB     # the kernel may split an edge page
    assert not t.any()
    t.fill_(1)
    assert host_memory.huge_pages_of(t) >= 6 * MB
    plain = torch.zeros(8 * MB, dtype=torch.uint8)
    plain.fill_(1)
    assert host_memory.huge_pages_of(plain) < host_memory.huge_pages_of(t)


def test_small_tensors_stay_plain():
    t = host_memory.zeros((1000, 512), torch.float32)       # 2,048,000 B: under 2 MiB
    assert not t.any() and t.shape == (1000, 512)
    assert host_memory.huge_pages_of(t) == 0


def test_the_mapping_lives_as_long_as_a_view():
    t = host_memory.zeros((4 * MB,), torch.uint8)
    view = t[-10:]
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
    view.fill_(3)                           # the mapping is still there under the view
    assert view.sum().item() == 30
