"""How a state slot's SWA ring keeps one token's K = V row.

    mxfp8   head_dim E4M3 bytes + one E8M0 scale per 32 values: 528 B at head_dim 512, the
            layout the design counts (docs/design.md §2); what float32 engines keep
    exact   the row's float64 bytes (8 x head_dim): --dtype float64, the exactness mode, so
            that the cached path reproduces the reference forward (and transformers) to the
            last bit the fp32 steps allow; 4,096 B at head_dim 512

The model rounds its window rows as the ring keeps them (`V4Model(stored=True, rows=...)`),
so a row read back from the ring is the number the chunk that wrote it attended.
"""

from __future__ import annotations

import torch

from kvmesh.kernels import mxfp8

FORMATS = ("mxfp8", "exact")


def for_dtype(dtype: str | torch.dtype) -> str:
    """The format an engine of this compute dtype keeps: exact in float64, else MXFP8."""
    return "exact" if dtype in ("float64", torch.float64) else "mxfp8"


def row_bytes(fmt: str, head_dim: int) -> int:
    _check(fmt)
    return mxfp8.token_bytes(head_dim) if fmt == "mxfp8" else 8 * head_dim


def encode(fmt: str, kv: torch.Tensor) -> torch.Tensor:
    """[n, head_dim] -> [n, row_bytes] uint8."""
    if fmt == "mxfp8":
        return mxfp8.quantize(kv)
    _check(fmt)
    return kv.to(torch.float64).contiguous().view(torch.uint8)


def decode(fmt: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, row_bytes] uint8 -> [n, head_dim] in `dtype`."""
    if fmt == "mxfp8":
        return mxfp8.dequantize(rows, dtype)
    _check(fmt)
    return rows.contiguous().view(torch.float64).to(dtype)


def round_like_stored(fmt: str, kv: torch.Tensor) -> torch.Tensor:
    """The values a reader of the ring sees for `kv`."""
    if fmt == "mxfp8":
        return mxfp8.fake_quantize(kv)
    _check(fmt)
    return kv.to(torch.float64).to(kv.dtype)


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"window row format must be one of {FORMATS}, not {fmt!r}")
