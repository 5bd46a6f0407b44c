"""Whole-row copies into and out of rings and tables on the CPU: kernels/cpu/rows.c, in the
library kernels/cpu_ring.py builds.

A decode step writes each sequence's new row into every layer's rings and reads some back by
index; torch's index_copy_ / index_put_ / index_select walk those rows element by element on
the CPU. Measured at 32 rows, 1 thread, in a decode step: 528-byte rows into a strided ring
~40 us, 2 KB mirror rows ~45 us, a [32, 75] gather of 128-byte indexer keys ~170 us; one
memcpy a row does each in a few microseconds.

`put` and `take` return False / None when they cannot run (no library, KVMESH_KERNELS set,
not a CPU tensor, rows that are not contiguous bytes): the caller then takes the torch op,
which moves the same bytes. Indices are checked against the ring's bounds in C before any
byte moves; a bad one raises IndexError like the torch ops.
"""

from __future__ import annotations

import math

import torch

from kernels import cpu_ring, dispatch


def _lib(*tensors):
    if dispatch.forced() is not None or any(t.device.type != "cpu" or t.requires_grad
                                            for t in tensors):
        return None
    return cpu_ring._load()


def _rows_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Each of t's rows (its dims after the first `lead`) is one contiguous run of bytes."""
    want = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != want:
            return False
        want *= size
    return True


def _places(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None):
    """(slot count, row count, slot stride, row stride in bytes, slots, rows) of `ring`
    [S, R, ...] addressed by (slots, rows), or [N, ...] addressed by slots alone (rows None)."""
    size = ring.element_size()
    slots = slots.reshape(-1).to(torch.int64).contiguous()
    if rows is None:
        return ring.shape[0], 0, ring.stride(0) * size, 0, slots, None
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    return ring.shape[0], ring.shape[1], ring.stride(0) * size, ring.stride(1) * size, slots, rows


def put(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None,
        src: torch.Tensor) -> bool:
    """ring[slots, rows] = src (ring[slots] = src with rows None); src [n, *ring.shape[lead:]]
    of ring's dtype, places distinct. False: not done here (use the torch op)."""
    lead = 1 if rows is None else 2
    lib = _lib(ring, src)
    if lib is None or src.dtype != ring.dtype or not _rows_contiguous(ring, lead):
        return False
    n_slots, n_rows, s_stride, r_stride, slots, rows = _places(ring, slots, rows)
    src = src.contiguous()
    width = math.prod(ring.shape[lead:]) * ring.element_size()
    if src.numel() * src.element_size() != slots.numel() * width:
        raise ValueError(f"{slots.numel()} rows of {tuple(ring.shape[lead:])} cannot take "
                         f"{tuple(src.shape)}")
    if lib.put_rows(ring.data_ptr(), n_slots, n_rows, s_stride, r_stride, slots.data_ptr(),
                    None if rows is None else rows.data_ptr(), src.data_ptr(), slots.numel(), width):
        raise IndexError(f"a place is outside the ring's {tuple(ring.shape[:lead])}")
    return True


def take(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None,
         shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """ring[slots, rows] (ring[slots] with rows None) -> [*shape, *row shape] (shape: the
    index's, default [n]); None: not done here (use the torch op)."""
    lead = 1 if rows is None else 2
    lib = _lib(ring)
    if lib is None or not _rows_contiguous(ring, lead):
        return None
    n_slots, n_rows, s_stride, r_stride, slots, rows = _places(ring, slots, rows)
    out = torch.empty(*(shape if shape is not None else (slots.numel(),)), *ring.shape[lead:],
                      dtype=ring.dtype)
    width = math.prod(ring.shape[lead:]) * ring.element_size()
    if lib.take_rows(ring.data_ptr(), n_slots, n_rows, s_stride, r_stride, slots.data_ptr(),
                     None if rows is None else rows.data_ptr(), out.data_ptr(), slots.numel(), width):
        raise IndexError(f"a place is outside the ring's {tuple(ring.shape[:lead])}")
    return out
