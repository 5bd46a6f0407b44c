"""Shared builders for engine tests."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.core.engine import EngineCore, Hooks
from services.engine.model import weights as weights_mod


class RecordingEngine(EngineCore):
    """EngineCore that keeps the logits each sampled token was drawn from."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def _emit(self, seq, logits, *args, **kw):
        rows = logits.clone() if logits.dim() == 2 else logits.clone()[None]
        event = super()._emit(seq, logits, *args, **kw)
        # a verify step's rows: one per emitted token (the rest judged rejected drafts)
        self.logits.setdefault(seq.request_id, []).extend(rows[: len(event.token_ids)])
        return event


def make_engine(cfg, dtype="float64", weights=None, seed=0, **ecfg) -> RecordingEngine:
    # verification is tested with every proposed draft verified: the adaptive policy's
    # choices depend on step times (tests/engine/core/test_draft_policy.py drives it by hand)
    ecfg.setdefault("spec_policy", "always")
    w = weights if weights is not None else weights_mod.init_weights(cfg, seed, getattr(torch, dtype))
    return RecordingEngine(cfg, EngineConfig(dtype=dtype, **ecfg), weights=w)


def run_to_completion(engine: EngineCore, check=True, max_steps=100000) -> int:
    steps = 0
    while engine.has_work:
        engine.step()
        if check:
            engine.check_integrity()
        steps += 1
        assert steps < max_steps
    return steps


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


class Recorder(Hooks):
    """Every block payload and stored snapshot an engine hands out (a block hash never
    changes its bytes)."""
    wants_blocks = True

    def __init__(self):
        self.blocks: dict[bytes, bytes] = {}
        self.published: dict[str, bytes] = {}

    def block_done(self, block_hash, payload, traffic_class):
        assert self.blocks.setdefault(block_hash, payload) == payload

    def snapshot_stored(self, key, snap):
        self.published[key] = snap.data
