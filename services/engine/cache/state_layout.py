"""Region: one named tensor's place in a state slot's bytes. The model's ledgers
(model/deepseek_v4/ledgers.py, v41_ledgers.py) lay each slot out as a list of them: the
stored SWA rings first (the prefix a snapshot persists), then what is rebuilt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    name: str
    layer: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]   # of the typed view
    dtype: str               # "uint8" | "float32"
