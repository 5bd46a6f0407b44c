"""What a DeepSeek V4 engine knows of its model and of each request besides the ledger bytes.

    ServedModel  the served model as the mesh reads it (GetModelInfo, block hashes)
    Request    one request's record; Engine alone writes its fields, on the engine thread
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from kvmesh import cachekeys
from kvmesh.services.engine.core.finish import Finish
from kvmesh.services.engine.core.prefix_reuse import Match
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4 import ledgers
from kvmesh.services.engine.model.deepseek_v4.config import V4Config
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config


@dataclass(frozen=True)
class ServedModel:
    """What the mesh reads of the served model: GetModelInfo's fields (the gateway parses
    name, vocab_size, block_size, window and max_seq_len from the JSON), and the model
    fingerprint every block hash and snapshot key carries."""
    name: str
    model: V4Config | V41Config
    block_size: int = BLOCK

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def window(self) -> int:
        return self.model.window

    @property
    def max_seq_len(self) -> int:
        return self.model.max_position

    @property
    def model_type(self) -> str:
        return "deepseek_v41" if isinstance(self.model, V41Config) else "deepseek_v4"

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "model_type": self.model_type,
                           "vocab_size": self.vocab_size, "block_size": self.block_size,
                           "window": self.window, "max_seq_len": self.max_seq_len,
                           "config": asdict(self.model)}, sort_keys=True)

    def fingerprint(self) -> str:
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        # part of every block hash and handoff check: computed once, not per call
        return cachekeys.model_fingerprint(json.loads(self.to_json()))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    salt: str = ""
    traffic_class: str = ""
    handoff: bool = False      # stop after the first token and keep it for a decode engine
    output: list[int] = field(default_factory=list)
    finish: Finish | None = None
    seq: ledgers.Sequence | None = None      # slot and block table while admitted
    chain: list[bytes] = field(default_factory=list)   # hashes of its complete blocks
    registered: int = 0                       # blocks registered for sharing
    snapshot_at: int | None = None            # the prompt boundary to snapshot at
    replay: Match | None = None               # a bounded replay the next step runs
    prefetched: Any = None                    # cache.prefix.Prefetched, until admission
    cached_tokens: int = 0
    replayed_tokens: int = 0
    cut: int | None = None                    # V4.1 truncation: the decoder runs from here
    scheduled_s: float = 0.0                  # time.monotonic() at admission (0: waiting)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def recent(self, n: int) -> list[int]:
        """The n tokens before the next one to compute (fewer at the start), without
        joining prompt and output: what a V4.1 Engram layer's n-grams read back into."""
        end, p = self.seq.length, len(self.prompt)
        start = max(end - n, 0)
        return self.prompt[start:min(end, p)] + self.output[max(start - p, 0):max(end - p, 0)]

    @property
    def prefilling(self) -> bool:      # what the Speculator asks (with slot and tokens)
        return self.seq is None or self.pending > 1

    @property
    def slot(self) -> int | None:
        return None if self.seq is None else self.seq.slot

    @property
    def pending(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.prompt) + len(self.output) - self.seq.length

    def max_blocks(self) -> int:
        """Blocks its whole generation can need: every token but the last one is computed."""
        return -(-(len(self.prompt) + self.params.max_tokens) // BLOCK)
