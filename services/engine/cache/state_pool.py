"""StatePool: the state ledger. Fixed slots, one per running sequence.

Owns the slot tensor and the free-slot list; only `allocate`/`free` change slot
ownership, and only CacheManager calls them. A slot is handed out whole at
admission and taken back whole when the sequence ends or is preempted: no block
table, no refcount, no eviction. The bytes of a slot belong to the sequence
holding it: ModelRunner writes them during that sequence's forwards, and
PrefixReuse.restore writes a snapshot into them while CacheManager admits it.

All slots live in one uint8 tensor `[num_slots, slot_bytes]`; every ring is a
typed view into it, laid out by `StateBlock` (see state_layout.py), so a
snapshot of the stored region is a plain byte slice. Slot count and ring
lengths come from the engine's one `RuntimeLayout`.
"""

from __future__ import annotations

import torch

from kernels import host_memory
from services.engine.cache.layout import RuntimeLayout


class NoFreeSlot(RuntimeError):
    pass


class StatePool:
    def __init__(self, layout: RuntimeLayout, device="cpu"):
        self.layout = layout
        self.cfg = layout.model
        self.block = layout.block
        self.num_slots = num_slots = layout.num_slots
        # on 2 MB pages: a decode step reads every slot's rings (kernels/host_memory.py)
        self.data = host_memory.zeros((num_slots, self.block.slot_bytes), torch.uint8, device)
        self.swa: dict[int, torch.Tensor] = {}   # layer -> [S, R, 528] uint8
        self.cmp: dict[int, torch.Tensor] = {}   # layer -> [S, m+B, 2, D] fp32
        self.idx: dict[int, torch.Tensor] = {}   # csa layer -> [S, m+B, 2, Di] fp32
        self.mtp: dict[int, torch.Tensor] = {}   # MTP ring -> [S, W+B, 528] uint8 (mtp drafts only)
        for r in self.block.regions():  # regions() runs the start-up layout check
            raw = self.data[:, r.offset : r.offset + r.nbytes]
            if r.dtype == "float32":
                raw = raw.view(torch.float32)
            view = raw.view(num_slots, *r.shape)
            {"swa": self.swa, "cmp": self.cmp, "idx": self.idx, "mtp": self.mtp}[r.name][r.layer] = view
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def ring(self) -> int:
        return self.block.swa_ring

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlot("no free state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise AssertionError(f"double free or bad slot {slot}")
        self._free.append(slot)

    def check_integrity(self, in_use: int) -> None:
        assert self.num_free + in_use == self.num_slots, (self.num_free, in_use, self.num_slots)
