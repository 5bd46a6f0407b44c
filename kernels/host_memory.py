"""Large host tensors on 2 MB pages (transparent huge pages), for the engine's long-lived CPU
state: the slot pool's rings, the block store's entries, the window mirror, the weight panels.

Why: a batch-32 decode step of the tiny model reads ~35 MB (17 MB of MXFP8 ring bytes, 17 MB
of weight panels, compressed entries 2 KB at a time) spread over ~9,000 pages of 4 KB: more
than a second-level TLB holds (a few thousand entries), so the step's reads keep walking
page tables, and hardware prefetchers stop at page boundaries (a slot's 67 KB window ring is
17 pages). Linux backs anonymous memory with 2 MB pages when asked (THP mode `madvise`, a
common default) or always (`always`). This module asks: an anonymous private mapping,
advised MADV_HUGEPAGE before any page is touched, its start rounded up to 2 MB.

`zeros` falls back to torch.zeros for device tensors, tensors under 2 MB, and systems
without MADV_HUGEPAGE. If the kernel declines the advice (THP `never`), the mapping keeps
its 4 KB pages and works as before. Every page is mapped before `zeros` returns (_fault_in).
The tensor keeps its mapping alive: torch.frombuffer holds the buffer, and the mapping is
unmapped with the tensor's last reference."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device), on 2 MB pages where that can be asked
    for (a CPU tensor of 2 MB or more, on a system with MADV_HUGEPAGE)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # one huge page more than needed, so that a 2 MB-aligned start fits inside (mmap gives
    # 4 KB alignment); the spare part is never touched, so it takes no memory
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(start) % HUGE_PAGE
    del start                   # an exported pointer would pin the mapping open for good
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, size)
    except OSError:             # advice refused (THP compiled out): 4 KB pages, same tensor
        pass
    t = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    _fault_in(t)
    return t


def _fault_in(t: torch.Tensor) -> None:
    """Touch one byte of every 4 KB of t (writing the zero it reads), so that every page is
    mapped now, as torch.zeros's fill did, and not at its first use in a step. With THP's
    `defrag` at `madvise` (a common default) a first touch of an advised region may compact
    memory to find a free 2 MB page: when a decode step first wrote fresh blocks' entries it
    took 25-34 ms instead of 5 (16 sequences, each entering a new block on the same step).
    One byte in 4 KB also maps every page where the kernel kept 4 KB pages."""
    t.view(-1).view(torch.uint8)[::4096].zero_()


def huge_pages_of(t: torch.Tensor) -> int:
    """Bytes on huge pages in the mappings under t's storage, read from /proc/self/smaps (0
    where it cannot be read): what the tests check."""
    lo = t.data_ptr()
    hi = lo + t.untyped_storage().nbytes()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a < hi and lo < b
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
