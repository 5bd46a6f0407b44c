"""The indexer's top-k picks of decode rows in one C call on the CPU (kernels/cpu/
indexer_topk.c, in the library cpu_ring.py builds): each row's candidates scored from their
indexer keys where they lie in the block store, the picks chosen by kernels/indexer.py's
rule and returned as kernels/indexer.topk_indices orders them, as table rows.

Why: per CSA layer torch gathers every candidate's key, runs an einsum, relu, a weighted sum,
two sorts and the gathers of the picks, ~20 calls: ~0.25 ms a layer at batch 1 (nearly all
per call) and ~0.45 ms at batch 32 on this machine. None from pick_rows: not done here (no
library, KVMESH_KERNELS set, not float32 on the CPU, autograd, more than MAX_K picks); the
caller takes the torch path, which picks the same entries up to score rounding (tested).
"""

from __future__ import annotations

import torch

from kernels import cpu_ring

MAX_K = 1024                 # the C file's MAX_K


def pick_rows(q: torch.Tensor, w: torch.Tensor, table: torch.Tensor, flat: torch.Tensor,
              visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q [T, Hi, Di], w [T, Hi] (each row's indexer query and head weights), table [N, Di]
    fp32 indexer keys, flat [T, K] long (table rows of each row's candidates), visible
    [T, K] bool -> (rows [T, k'], ok [T, k']) with k' = min(k, K): the picked candidates'
    table rows, visible picks first, each part by candidate index."""
    t, kc = q.shape[0], flat.shape[-1]
    if tuple(flat.shape) != (t, kc) or tuple(visible.shape) != (t, kc):
        raise ValueError(f"indexer picks: q {tuple(q.shape)}, flat {tuple(flat.shape)}, "
                         f"visible {tuple(visible.shape)} do not fit together")
    return _picks(q, w, table, flat, k, visible=visible.to(torch.bool).contiguous())


def pick_rows_of_works(q: torch.Tensor, w: torch.Tensor, table: torch.Tensor,
                       flat: torch.Tensor, row_work: torch.Tensor, n_visible: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """pick_rows where the rows' candidates are their works' lists: flat [U, K] (table rows
    of each work's entries 0 .. K - 1), row_work [T] (each row's work among the U) and
    n_visible [T] (row t sees entries j < n_visible[t]). The same picks as pick_rows on
    flat[row_work] and that prefix mask, without building either: a chunk's rows share one
    list (at 4K tokens ~1000 candidates a row, 9 KB of index and mask per row)."""
    t = q.shape[0]
    if flat.dim() != 2 or tuple(row_work.shape) != (t,) or tuple(n_visible.shape) != (t,):
        raise ValueError(f"indexer picks: q {tuple(q.shape)}, flat {tuple(flat.shape)}, "
                         f"row_work {tuple(row_work.shape)}, n_visible "
                         f"{tuple(n_visible.shape)} do not fit together")
    return _picks(q, w, table, flat, k, row_work=row_work.to(torch.int64).contiguous(),
                  n_visible=n_visible.to(torch.int64).contiguous())


def _picks(q, w, table, flat, k, visible=None, row_work=None, n_visible=None):
    lib = cpu_ring.library(q, (torch.float32,))
    kc = flat.shape[-1]
    kk = min(k, kc)
    if lib is None or w.dtype != torch.float32 or table.dtype != torch.float32 or \
            table.dim() != 2 or table.stride(1) != 1 or kk > MAX_K or kk == 0:
        return None
    t, hi, di = q.shape
    if table.shape[1] != di or tuple(w.shape) != (t, hi):
        raise ValueError(f"indexer picks: q {tuple(q.shape)}, w {tuple(w.shape)}, table "
                         f"{tuple(table.shape)} do not fit together")
    q, w = q.contiguous(), w.contiguous()
    flat = flat.to(torch.int64).contiguous()
    rows = torch.empty(t, kk, dtype=torch.int64)
    ok = torch.empty(t, kk, dtype=torch.bool)
    ptr = [None if x is None else x.data_ptr() for x in (visible, row_work, n_visible)]
    rc = lib.indexer_topk_f32(q.data_ptr(), w.data_ptr(), table.data_ptr(), table.stride(0),
                              flat.data_ptr(), ptr[0], t, hi, di, kc, kk, rows.data_ptr(),
                              ok.data_ptr(), torch.get_num_threads(), ptr[1], ptr[2])
    if rc:
        raise ValueError(f"indexer_topk refused k {kk} of {kc} (rc {rc})")
    return rows, ok
