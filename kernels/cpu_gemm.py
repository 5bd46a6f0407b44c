"""`x @ w` on the CPU (float32, float64) in one call of kernels/cpu/gemm.c (in the library
cpu_ring.py builds), where torch would call MKL's sgemm / dgemm.

Why: every projection of the model is a product of a few rows by a weight, and on AMD CPUs
MKL takes its AVX2 path: ~100 GFLOP/s a core at large M, ~70 at a decode step's 32 rows,
and at 32 rows it hardly uses a second thread. The C tile (8 rows x 32 columns of AVX-512
accumulators, or 6 rows x 16 columns with AVX2; column tiles split over the threads, the
weight's rows prefetched) measured on the development machine (AMD EPYC with AVX-512, 2
threads, weights in cache): 32 x 128 @ 128 x 1024
77 -> 25 us, 32 x 1024 @ 1024 x 128 56 -> 23 us, 512 x 128 @ 128 x 1024 0.70 -> 0.34 ms;
weights cold from memory 142 -> 60 us; one row 7 -> 5 us (the call adds ~2.5 us to either).

Each output element is an FMA chain over k in order (pieces of 256 added in order), so a
row's result does not depend on the other rows of the call or on the thread count (tested,
bit for bit). MKL's does: on the development machine a row alone and the same row among
six differ in fp32 and fp64, and a float64 speculative run then stored other cache bytes
than a plain one (test_spec_decode failed at ed0130c there). Its error is MKL's (tested
within 1.5x, fp32 against float64, fp64 against x87 extended precision).

The model's weights are packed once (`pack_weights`, at the runner's construction) into column
panels, [ceil(N / T)][K][T] with T the tile's columns (`panel_cols`: 32 fp32 and 16 fp64
with AVX-512, 16 and 8 with AVX2): each tile of the kernel
then reads one contiguous stream where, as stored, it reads 128 bytes out of every row of
w. The same FMA chains, so the same bits (tested); the 73 products of a tiny decode step
1.67 -> 1.28 ms at 32 rows and 0.96 -> 0.76 ms at one row (weights cycling through L3). A
packed copy follows its weight: an in-place change (the tensor's version counter) repacks it
on the next product, and it is dropped with the weight. Memory: one more copy of each packed
weight (the tiny preset: 17 MB).

matmul() takes torch's mm wherever the library does not (cpu_ring.library's gate: not a CPU
float32/float64 tensor, autograd, KVMESH_KERNELS set, no compiler; a weight of another dtype
or layout; a CPU without AVX2 and FMA: the C call says so once).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from kernels import cpu_ring, host_memory

_refused = False          # the library was built without AVX2 + FMA: gemm_* answered -1
_F32 = torch.float32
_DTYPES = (torch.float32, torch.float64)
# id(weight) -> (its version when packed, panels). Keyed by id, not by the tensor (a tensor's
# == is elementwise); a finalizer drops the entry with the weight, before its id can be
# reused. Owned here: pack_weights adds entries, _panels refreshes them.
_packed: dict[int, tuple[int, torch.Tensor]] = {}


def pack_weights(weights: Iterable[torch.Tensor]) -> None:
    """Pack weights for the products now (ModelRunner packs the model's at construction, so a
    first request's time does not include it). Only 2-D CPU float32 / float64 tensors, and
    only where the products take the kernel; others are left alone."""
    todo = [w for w in weights if not _refused and cpu_ring.library(w, _DTYPES) is not None
            and w.dim() == 2 and w.dtype in _DTYPES and id(w) not in _packed
            and panel_cols(w.dtype) > 0]
    # one arena per dtype on 2 MB pages (kernels/host_memory.py): the weights are many small
    # tensors (0.06-0.5 MB each for tiny) that a batched step reads in full, each a
    # separate run of 4 KB pages otherwise
    sizes = [_panel_numel(w) for w in todo]
    total: dict[torch.dtype, int] = {}
    for w, n in zip(todo, sizes, strict=True):
        total[w.dtype] = total.get(w.dtype, 0) + n
    arena = {dtype: host_memory.zeros((n,), dtype) for dtype, n in total.items()}
    at = dict.fromkeys(arena, 0)
    for w, n in zip(todo, sizes, strict=True):
        _packed[id(w)] = (w._version, pack(w, arena[w.dtype][at[w.dtype]: at[w.dtype] + n]))
        at[w.dtype] += n
        weakref.finalize(w, _packed.pop, id(w), None)


def panel_cols(dtype: torch.dtype) -> int:
    """The kernel tile's columns for `dtype` (float32 or float64), which packed panels must
    have: two vectors of the widest kind the library was built for. Asks the library (built
    for this CPU); 0 where it has no products (no library, a CPU without AVX2 + FMA): nothing
    is packed then."""
    lib = cpu_ring.load()
    return lib.gemm_panel_cols(dtype.itemsize) if lib is not None else 0


def _panel_numel(w: torch.Tensor) -> int:
    """Elements of w's panels: a multiple of T (128 bytes with AVX-512, 64 with AVX2), so in
    an arena each weight's panels start on a cache line."""
    k, n = w.shape
    t = panel_cols(w.dtype)
    return k * -(-n // t) * t


def pack(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w [K, N] as panels [ceil(N / T), K, T] (columns past N zero), T = panel_cols(w.dtype);
    written into `out` (a flat tensor of w's dtype, exactly their size) when given."""
    k, n = w.shape
    t = panel_cols(w.dtype)
    wide = w.new_zeros(k, -(-n // t) * t)
    wide[:, :n] = w
    panels = wide.view(k, -1, t).permute(1, 0, 2)
    if out is None:
        return panels.contiguous()
    return out.view(panels.shape).copy_(panels)


def _panels(w: torch.Tensor) -> torch.Tensor | None:
    """w's packed panels, repacked if w changed in place since; None for a tensor not packed
    (activations, pooled keys: packing each would cost a copy)."""
    held = _packed.get(id(w))
    if held is None:
        return None
    if held[0] != w._version:
        held = _packed[id(w)] = (w._version, pack(w))
    return held[1]


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] -> [..., N], float32 or float64. Called for every projection of
    every layer (73 a decode step of the tiny preset), so the checks are a few attribute
    reads (a tensor attribute costs ~0.1 us: the first version of this wrapper added 4 us
    to each call). One row takes the kernel too: a sequence's numbers are the same alone
    and in a batch (a verify step's rows and a decode step's row write the same cache
    bytes: test_spec_decode)."""
    global _refused
    if _refused or w.dtype is not x.dtype or w.requires_grad or w.dim() != 2 \
            or not w.is_contiguous():
        return x @ w
    lib = cpu_ring.library(x, _DTYPES)
    k, n = w.shape
    if lib is None or x.shape[-1] != k:     # (a wrong K: torch's error)
        return x @ w
    if not x.is_contiguous():
        x = x.contiguous()
    m = x.numel() // k
    out = torch.empty(m, n, dtype=x.dtype)  # ints: a shape built from x.shape costs 1 us more
    panels = _panels(w)
    if panels is not None:
        fn = lib.gemm_packed_f32 if x.dtype is _F32 else lib.gemm_packed_f64
        rc = fn(x.data_ptr(), k, panels.data_ptr(), out.data_ptr(), n, m, k, n,
                torch.get_num_threads())
    else:
        fn = lib.gemm_f32 if x.dtype is _F32 else lib.gemm_f64
        rc = fn(x.data_ptr(), k, w.data_ptr(), n, out.data_ptr(), n, m, k, n,
                torch.get_num_threads())
    if rc:
        if rc < 0:
            _refused = True
            _packed.clear()          # no product will read them
            return x @ w
        raise ValueError(f"gemm refused {tuple(x.shape)} @ {tuple(w.shape)} (rc {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
