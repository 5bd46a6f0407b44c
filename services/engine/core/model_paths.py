"""What Engine does differently for DeepSeek V4 and V4.1: one object per model family,
owning the engine's ledgers and the calls that depend on the family.

    ledgers      Ledgers (V4) or V41Ledgers (V4.1), sized from the engine config
    snapshots    the module that takes and restores a window snapshot (snapshots.py /
                 v41_snapshots.py)
    period       the snapshot policy the engine keeps (V4.1 without truncation: none, since
                 its decoder rings are never stored and a hit there could not be exact)
    cut(n)       where a prompt of n tokens starts its decoder (V4.1 truncation), or None
    forward      one ledger step: each work's logits and last-layer streams (MTP's input)
    replay       the bounded replay of a block hit without a snapshot
    mtp()        the MTP module `--speculative mtp:K` drafts with, or None without one
"""

from __future__ import annotations

from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.model.deepseek_v4 import (
    ledgers,
    mtp,
    snapshots,
    v41_ledgers,
    v41_mtp,
    v41_snapshots,
    window_rows,
)
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule


class V4Path:
    snapshots = snapshots

    def __init__(self, model: V4Model, ecfg: EngineConfig):
        refuse_unsupported(ecfg)
        if not model.stored:
            raise ValueError("Engine needs a model built with stored=True (ledger roundings)")
        self.model = model
        self.ledgers = ledgers.Ledgers(model.whole, ecfg.num_slots, ecfg.num_blocks,
                                       ecfg.extra_state, rows=model.rows, device=model.device)
        self.period = ecfg.snapshot_period

    def cut(self, n_tokens: int) -> int | None:
        return None

    lookback = 0        # tokens before a chunk its forward reads (V4 reads none)

    def forward(self, works, cuts, before):
        return ledgers.step(self.model, self.ledgers, works, streams_too=True)

    def replay(self, seq, tokens, hit: int, cut: int | None):
        return ledgers.replay(self.model, self.ledgers, seq, tokens, hit)

    def mtp(self) -> mtp.MtpModule | None:
        return mtp.MtpModule(self.model) if mtp.has_mtp(self.model.weights) else None


class V41Path:
    snapshots = v41_snapshots

    def __init__(self, model: V41Model, ecfg: EngineConfig):
        ecfg.check_model(model.whole)    # KEEP >= W + B under truncation
        self.model = model
        self.ledgers = v41_ledgers.V41Ledgers(model.whole, ecfg.num_slots, ecfg.num_blocks,
                                              ecfg.extra_state,
                                              rows=window_rows.for_dtype(model.dtype),
                                              dtype=model.dtype, device=model.device)
        self.truncation, self.keep = ecfg.truncation, ecfg.keep_tokens
        # a snapshot hit is exact only when the decoder starts at or past it, which
        # truncation guarantees (hits stop at its cut)
        self.period = ecfg.snapshot_period if self.truncation != "off" else None
        self.mode = "compact" if self.truncation == "off" else self.truncation
        self.lookback = v41_ledgers.lookback(model.whole)     # Engram's n-grams

    def cut(self, n_tokens: int) -> int | None:
        """Under truncation a prompt's decoder runs on its last --keep-tokens tokens."""
        if self.truncation != "off" and n_tokens > self.keep:
            return n_tokens - self.keep
        return None

    def forward(self, works, cuts, before):
        # under truncation a chunk's streams are those of the rows past its cut only
        return v41_ledgers.step(self.model, self.ledgers, works, cuts, self.mode,
                                streams_too=True, before=before)

    def replay(self, seq, tokens, hit: int, cut: int | None):
        return v41_ledgers.replay(self.model, self.ledgers, seq, tokens, hit, cut, self.mode)

    def mtp(self) -> V41MtpModule | None:
        return V41MtpModule(self.model) if v41_mtp.has_mtp(self.model.weights) else None


def model_path(model: V4Model | V41Model, ecfg: EngineConfig) -> V4Path | V41Path:
    return V41Path(model, ecfg) if isinstance(model, V41Model) else V4Path(model, ecfg)


def refuse_unsupported(ecfg: EngineConfig) -> None:
    """Settings the DeepSeek V4 path does not serve yet: refused, never ignored."""
    refused = [(ecfg.truncation != "off", "--truncation")]
    named = [flag for on, flag in refused if on]
    if named:
        raise ValueError(f"{', '.join(named)}: not served for DeepSeek V4 checkpoints yet "
                         "(docs/deepseek-v4.md)")
