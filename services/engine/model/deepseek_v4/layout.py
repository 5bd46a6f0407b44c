"""The two cache ledgers a DeepSeek V4 config implies, in bytes (`kvmesh engine layout --model`).

State ledger, one slot per running sequence (fixed size, freed whole):

    | SWA ring, layer 0 | ... | layer L-1 |   every layer: R rows x 528 B (MXFP8)     stored
    | CSA l: compressor | indexer | HCA l': compressor | ...  fp32 open tails           dropped
    (MTP window:   W + B rows x 528 B a drafting request; Engine keeps it outside the
                   slot, in host memory (core/mtp_draft.py), so the slot has no region for it)

  - a ring row is one token's K = V vector as MXFP8: head_dim E4M3 bytes + one E8M0 scale per
    32 values (512 + 16 = 528 B at head_dim 512); R = W + B = 134 (B = 6 rollback tokens), or
    134 + 128 + 134 = 396 on a prefill engine with --extra-state;
  - a compressor's tail holds the raw kv and gate projections (fp32) of the tokens it still
    needs: HCA the open window plus B (m + B rows of 2 x c); CSA also the last closed window,
    whose A series the next entry pools (2m + B rows of 2 x 2c); the indexer likewise at c_I.

Block ledger, paged by 128 tokens (shared by prefix, refcounted, LRU): per CSA layer the
block's 128 / m entries and as many indexer keys, per HCA layer its 128 / m' entries, fp32 as
the engine's block store keeps them. Sliding-only layers put nothing in blocks.
"""

from __future__ import annotations

from kvmesh.services.engine.model.deepseek_v4 import window_rows
from kvmesh.services.engine.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config

FP32 = 4
BLOCK_TOKENS = 128
BACKTRACK = 6            # speculative rollback tokens (B)
PREFILL_STORE_EXTRA = 128
KEEP_TOKENS = 134


def row_bytes(cfg: V4Config, rows: str = "mxfp8") -> int:
    """One ring row (window_rows.py: 528 B MXFP8 at head_dim 512; exact in float64)."""
    return window_rows.row_bytes(rows, cfg.head_dim)


def ring_rows(cfg: V4Config, extra_state: bool) -> int:
    inference = cfg.window + BACKTRACK
    return inference + (PREFILL_STORE_EXTRA + KEEP_TOKENS if extra_state else 0)


def tail_bytes(cfg: V4Config, kind: str) -> dict[str, int]:
    """fp32 open-tail state of one compressed layer, by compressor."""
    if kind == HCA:
        return {"compressor": (cfg.hca_rate + BACKTRACK) * 2 * cfg.head_dim * FP32}
    if kind == CSA:
        rows = 2 * cfg.csa_rate + BACKTRACK
        return {"compressor": rows * 2 * 2 * cfg.head_dim * FP32,
                "indexer": rows * 2 * 2 * cfg.index_head_dim * FP32}
    return {}


def overlap_bytes(cfg: V4Config) -> int:
    """What a snapshot carries beyond the rings: per CSA layer, the A series (kv and gate,
    fp32) of the m tokens before its position, for the compressor and the indexer."""
    return (cfg.layer_kinds.count(CSA) * cfg.csa_rate * 2
            * (cfg.head_dim + cfg.index_head_dim) * FP32)


def block_bytes_per_layer(cfg: V4Config, kind: str) -> int:
    if kind == CSA:
        return BLOCK_TOKENS // cfg.csa_rate * (cfg.head_dim + cfg.index_head_dim) * FP32
    if kind == HCA:
        return BLOCK_TOKENS // cfg.hca_rate * cfg.head_dim * FP32
    return 0


def report(cfg: V4Config, extra_state: bool = False, memory: int | None = None,
           rows_format: str = "mxfp8") -> dict:
    for rate in (cfg.csa_rate, cfg.hca_rate):
        if BLOCK_TOKENS % rate:
            raise ValueError(f"compress rate {rate} does not divide the {BLOCK_TOKENS}-token block")
    rows, row = ring_rows(cfg, extra_state), row_bytes(cfg, rows_format)
    kinds = {k: cfg.layer_kinds.count(k) for k in (SLIDING, CSA, HCA)}
    swa = cfg.num_layers * rows * row
    tails = {k: tail_bytes(cfg, k) for k in (CSA, HCA)}
    compression = sum(kinds[k] * sum(tails[k].values()) for k in (CSA, HCA))
    block = sum(kinds[k] * block_bytes_per_layer(cfg, k) for k in (CSA, HCA))
    padding = -swa % FP32  # the fp32 tails start 4-byte aligned (rows of 528 B always are)
    slot = swa + padding + compression
    out = {
        "model": {"layers": cfg.num_layers, "by_kind": kinds, "window": cfg.window,
                  "head_dim": cfg.head_dim, "csa_rate": cfg.csa_rate, "hca_rate": cfg.hca_rate,
                  "index_head_dim": cfg.index_head_dim, "mtp_layers": cfg.num_mtp_layers},
        "state_slot": {
            "swa_row_format": rows_format, "swa_row_bytes": row, "swa_ring_rows": rows, "extra_state": extra_state,
            "swa_bytes_per_layer": rows * row, "swa_bytes": swa,
            "state_size_to_disk": cfg.num_layers * ring_rows(cfg, False) * row,
            # a snapshot also carries each CSA layer's overlap: the A series (kv, gate) of the
            # window before its position, for the compressor and the indexer (snapshots.py)
            "snapshot_bytes": cfg.num_layers * ring_rows(cfg, False) * row + overlap_bytes(cfg),
            "padding": padding,
            "compression_tail_bytes_per_layer": tails, "compression_bytes": compression,
            "mtp_ring_bytes": cfg.num_mtp_layers * ring_rows(cfg, False) * row,
            "bytes": slot},
        "block": {"tokens": BLOCK_TOKENS, "bytes": block,
                  "bytes_per_token_per_layer": {k: block_bytes_per_layer(cfg, k) / BLOCK_TOKENS
                                                for k in (SLIDING, CSA, HCA)},
                  "blocks_per_gib": (1 << 30) // block if block else None},
        "memory": None,
    }
    if memory is not None:
        slots = memory // slot
        out["memory"] = {"budget": memory, "slots_only": slots,
                         "tokens_per_gib_of_blocks": (1 << 30) // block * BLOCK_TOKENS
                         if block else None}
    return out


def table(rep: dict) -> str:
    m, s, b = rep["model"], rep["state_slot"], rep["block"]
    lines = [
        f"model: {m['layers']} layers ({m['by_kind']['sliding']} sliding, {m['by_kind']['csa']} "
        f"CSA m={m['csa_rate']}, {m['by_kind']['hca']} HCA m={m['hca_rate']}), window "
        f"{m['window']}, head_dim {m['head_dim']}",
        "state slot (one per running sequence):",
        f"  SWA ring         {s['swa_ring_rows']} rows x {s['swa_row_bytes']} B "
        f"({s['swa_row_format']}) x {m['layers']} layers = {s['swa_bytes']:,} B"
        + ("  (--extra-state)" if s["extra_state"] else ""),
        f"  persisted prefix {s['state_size_to_disk']:,} B (134-row rings); a snapshot "
        f"{s['snapshot_bytes']:,} B with the CSA overlap",
    ]
    for kind, parts in s["compression_tail_bytes_per_layer"].items():
        if m["by_kind"][kind]:
            desc = ", ".join(f"{k} {v:,} B" for k, v in parts.items())
            lines.append(f"  {kind.upper() + ' tails':<16} {desc} per layer")
    lines += [f"  compression      {s['compression_bytes']:,} B",
              f"  slot total       {s['bytes']:,} B",
              f"  MTP window       {s['mtp_ring_bytes']:,} B a request drafting with MTP "
              "(host memory, outside the slot)",
              f"block ledger ({b['tokens']} tokens a block): {b['bytes']:,} B a block, "
              f"{b['blocks_per_gib']} blocks per GiB",
              "  bytes per token per layer: " + ", ".join(
                  f"{k} {v:g}" for k, v in b["bytes_per_token_per_layer"].items())]
    if rep["memory"]:
        mem = rep["memory"]
        lines.append(f"memory {mem['budget']:,} B: {mem['slots_only']} slots if it held slots "
                     f"only; {mem['tokens_per_gib_of_blocks']:,} cached tokens per GiB of blocks")
    return "\n".join(lines)
