"""`kvmesh engine layout --memory`: a memory budget as written on the command line, in bytes
(the reports themselves: model/deepseek_v4/layout.py and v41_layout.py)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """'80GiB', '512MB', '1.5GiB', '1000000' -> bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"memory budget {text!r}: use a byte count or a size like 80GiB, 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
