"""Whole-row copies into and out of rings and tables on the CPU: kernels/cpu/rows.c, in the
library kernels/cpu_ring.py builds.

A decode step writes each sequence's new row into every layer's rings and reads some back by
index; torch's index_copy_ / index_put_ / index_select walk those rows element by element on
the CPU. Measured at 32 rows, 1 thread, in a decode step: 528-byte rows into a strided ring
~40 us, 2 KB mirror rows ~45 us, a [32, 75] gather of 128-byte indexer keys ~170 us; one
memcpy a row does each in a few microseconds.

`put` and `take` return False / None when they cannot run (no library, KVMESH_KERNELS set,
not a CPU tensor, rows that are not contiguous bytes) or would not pay (fewer than MIN_ROWS
rows or MIN_BYTES bytes): the caller then takes the torch op, which moves the same bytes. Indices are checked against the ring's bounds in C before any
byte moves; a bad one raises IndexError like the torch ops.
"""

from __future__ import annotations

import math
import os

import torch

from kernels import cpu_ring, dispatch


# (data pointer, shape, strides, dtype, lead) of a ring -> its geometry (n_slots, n_rows,
# slot stride, row stride, row bytes), or None when its rows are not contiguous bytes. The
# engine's rings live as long as it does, so a step's calls are dictionary hits: the wrapper
# costs ~3 us a call where recomputing this cost ~15 (a one-row put was 5x torch's).
_GEOMETRY: dict[tuple, tuple | None] = {}


# Below this many rows or bytes torch's op is the cheaper call: the wrapper and ctypes cost
# ~8 us, a torch index_copy_ of one row ~3 us; at 32 rows of 2 KB both ~11 us hot, and in a
# decode step (cold rows) torch's took ~45 us.
MIN_ROWS, MIN_BYTES = 8, 8192


def _lib(a: torch.Tensor, b: torch.Tensor | None = None):
    if a.device.type != "cpu" or a.requires_grad or (b is not None and (
            b.device.type != "cpu" or b.requires_grad)):
        return None
    if os.environ.get("KVMESH_KERNELS") and dispatch.forced() is not None:
        return None
    return cpu_ring._load()


def _geometry(t: torch.Tensor, lead: int) -> tuple | None:
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, lead)
    if key in _GEOMETRY:
        return _GEOMETRY[key]
    size, want = t.element_size(), 1
    geometry = None
    for n, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if n != 1 and stride != want:
            break
        want *= n
    else:
        geometry = (t.shape[0], t.shape[1] if lead == 2 else 0, t.stride(0) * size,
                    t.stride(1) * size if lead == 2 else 0, math.prod(t.shape[lead:]) * size)
    if len(_GEOMETRY) > 1024:          # tensors come and go in tests: keep it bounded
        _GEOMETRY.clear()
    _GEOMETRY[key] = geometry
    return geometry


def _index(i: torch.Tensor | None) -> torch.Tensor | None:
    if i is None or (i.dtype is torch.int64 and i.is_contiguous()):
        return i
    return i.reshape(-1).to(torch.int64).contiguous()


def put(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None,
        src: torch.Tensor) -> bool:
    """ring[slots, rows] = src (ring[slots] = src with rows None); src [n, *ring.shape[lead:]]
    of ring's dtype, places distinct. False: not done here (use the torch op)."""
    if slots.numel() < MIN_ROWS or src.numel() * src.element_size() < MIN_BYTES:
        return False
    lib = _lib(ring, src)
    geometry = None if lib is None or src.dtype != ring.dtype else \
        _geometry(ring, 1 if rows is None else 2)
    if geometry is None:
        return False
    n_slots, n_rows, s_stride, r_stride, width = geometry
    slots, rows, src = _index(slots), _index(rows), src.contiguous()
    if src.numel() * src.element_size() != slots.numel() * width:
        raise ValueError(f"{slots.numel()} rows of {width} B cannot take {tuple(src.shape)} "
                         f"{src.dtype}")
    if lib.put_rows(ring.data_ptr(), n_slots, n_rows, s_stride, r_stride, slots.data_ptr(),
                    None if rows is None else rows.data_ptr(), src.data_ptr(), slots.numel(), width):
        raise IndexError(f"a place is outside the ring's {tuple(ring.shape[:1 if rows is None else 2])}")
    return True


def take(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None,
         shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """ring[slots, rows] (ring[slots] with rows None) -> [*shape, *row shape] (shape: the
    index's, default [n]); None: not done here (use the torch op)."""
    lead = 1 if rows is None else 2
    if slots.numel() < MIN_ROWS:
        return None
    lib = _lib(ring)
    geometry = None if lib is None else _geometry(ring, lead)
    if geometry is None or slots.numel() * geometry[4] < MIN_BYTES:
        return None
    n_slots, n_rows, s_stride, r_stride, width = geometry
    slots, rows = _index(slots), _index(rows)
    out = torch.empty(*(shape if shape is not None else (slots.numel(),)), *ring.shape[lead:],
                      dtype=ring.dtype)
    if lib.take_rows(ring.data_ptr(), n_slots, n_rows, s_stride, r_stride, slots.data_ptr(),
                     None if rows is None else rows.data_ptr(), out.data_ptr(), slots.numel(), width):
        raise IndexError(f"a place is outside the ring's {tuple(ring.shape[:lead])}")
    return out
