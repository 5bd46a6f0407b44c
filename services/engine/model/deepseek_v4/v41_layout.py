"""The two cache ledgers a DeepSeek V4.1 config implies, in bytes (`kvmesh engine layout`).

State ledger, one slot per running sequence (fixed size, freed whole):

    | SWA rings of the encoder layers | SWA rings of the decoder layers | KV-source tails |
      stored region (a snapshot)        dropped region: rebuilt by recomputation, never stored

  - every layer has a ring of R rows, one token's K = V vector a row (528 B as MXFP8 at
    head_dim 512); R = W + B = 134, or 396 on a prefill engine with --extra-state;
  - the encoder is the layers before the last KV source (0-19 on V4.1-Flash), so a snapshot
    is 20 x 134 x 528 = 1,415,040 B there; the decoder (20-39) reads the encoder's compressed
    entries and its rings serve only the tokens after a prompt (decoder-side replay);
  - a KV source whose ratio pools (m > 1) keeps the raw kv and gate projections (fp32) of its
    open group plus B rows for rollback: (m + B) rows of 2 x d. A ratio-1 source has no tail.

Block ledger, paged by 128 tokens: per KV source the block's 128 / m entries and as many index
keys (fp32, as the engine's block store keeps them). Consumers put nothing in blocks.
"""

from __future__ import annotations

import torch

from kvmesh.services.engine.model.deepseek_v4 import window_rows
from kvmesh.services.engine.model.deepseek_v4.layout import (
    BACKTRACK,
    BLOCK_TOKENS,
    KEEP_TOKENS,
    PREFILL_STORE_EXTRA,
)
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config


def encoder_layers(cfg: V41Config) -> int:
    """Layers whose rings a snapshot stores: those before the decoder (all without one)."""
    return cfg.decoder_start if cfg.decoder_start is not None else cfg.num_layers


def ring_rows(cfg: V41Config, extra_state: bool) -> int:
    return cfg.window + BACKTRACK + (PREFILL_STORE_EXTRA + KEEP_TOKENS if extra_state else 0)


def tail_bytes(cfg: V41Config, layer: int, size: int = 4) -> int:
    """Open-group state of KV source `layer`, `size` bytes a value (0 at ratio 1: nothing
    stays open)."""
    m = cfg.ratio(layer)
    return (m + BACKTRACK) * 2 * cfg.head_dim * size if m > 1 else 0


def block_bytes_per_source(cfg: V41Config, layer: int, size: int = 4) -> int:
    return BLOCK_TOKENS // cfg.ratio(layer) * (cfg.head_dim + cfg.index_head_dim) * size


def report(cfg: V41Config, extra_state: bool = False, memory: int | None = None,
           rows_format: str = "mxfp8", state_dtype: torch.dtype = torch.float32) -> dict:
    """state_dtype: what tails and blocks keep (fp32; float64 for a float64 engine)."""
    for layer in cfg.kv_sources:
        if BLOCK_TOKENS % cfg.ratio(layer):
            raise ValueError(f"compress ratio {cfg.ratio(layer)} of layer {layer} does not divide "
                             f"the {BLOCK_TOKENS}-token block")
    rows, row = ring_rows(cfg, extra_state), window_rows.row_bytes(rows_format, cfg.head_dim)
    encoder = encoder_layers(cfg)
    stored, dropped = encoder * rows * row, (cfg.num_layers - encoder) * rows * row
    size = state_dtype.itemsize
    tails = {layer: tail_bytes(cfg, layer, size) for layer in cfg.kv_sources}
    compression = sum(tails.values())
    padding = -(stored + dropped) % size
    slot = stored + dropped + padding + compression
    block = sum(block_bytes_per_source(cfg, layer, size) for layer in cfg.kv_sources)
    to_disk = encoder * ring_rows(cfg, False) * row
    out = {
        "model": {"model_type": "deepseek_v41", "layers": cfg.num_layers,
                  "window": cfg.window, "head_dim": cfg.head_dim,
                  "index_head_dim": cfg.index_head_dim, "ratios": list(cfg.ratios),
                  "kv_sources": list(cfg.kv_sources), "index_sources": list(cfg.index_sources),
                  "encoder_layers": encoder, "decoder_layers": cfg.num_layers - encoder,
                  "engram": _engram(cfg)},
        "state_slot": {
            "swa_row_format": rows_format, "state_dtype": str(state_dtype).removeprefix("torch."),
            "swa_row_bytes": row, "swa_ring_rows": rows,
            "extra_state": extra_state, "swa_bytes_per_layer": rows * row,
            "stored_swa_bytes": stored, "dropped_swa_bytes": dropped,
            "state_size_to_disk": to_disk, "snapshot_bytes": to_disk,
            "padding": padding, "compression_tail_bytes_per_source": tails,
            "compression_bytes": compression, "bytes": slot},
        "block": {"tokens": BLOCK_TOKENS, "bytes": block,
                  "bytes_per_source": {layer: block_bytes_per_source(cfg, layer, size)
                                       for layer in cfg.kv_sources},
                  "blocks_per_gib": (1 << 30) // block if block else None},
        "memory": None,
    }
    if memory is not None:
        out["memory"] = {"budget": memory, "slots_only": memory // slot,
                         "tokens_per_gib_of_blocks": (1 << 30) // block * BLOCK_TOKENS
                         if block else None}
    return out


def _engram(cfg: V41Config) -> dict | None:
    """Engram's tables are weights; a sequence keeps no Engram state beyond its tokens."""
    e = cfg.engram
    if e is None:
        return None
    return {"layers": list(e.layers), "table_rows": list(e.rows), "head_dim": e.head_dim,
            "table_bytes_fp8": sum(e.rows) * (e.head_dim + e.head_dim // 32),
            "tokens_kept": e.max_ngram - 1}


def table(rep: dict) -> str:
    m, s, b = rep["model"], rep["state_slot"], rep["block"]
    enc, dec = m["encoder_layers"], m["decoder_layers"]
    lines = [
        f"model: DeepSeek V4.1, {m['layers']} layers (encoder 0-{enc - 1}, decoder "
        f"{enc}-{m['layers'] - 1}), KV sources {m['kv_sources']}, window {m['window']}, "
        f"head_dim {m['head_dim']}",
        "state slot (one per running sequence):",
        f"  SWA ring         {s['swa_ring_rows']} rows x {s['swa_row_bytes']} B "
        f"({s['swa_row_format']}) a layer" + ("  (--extra-state)" if s["extra_state"] else ""),
        f"  stored region    {enc} encoder rings = {s['stored_swa_bytes']:,} B; a snapshot "
        f"{s['snapshot_bytes']:,} B (134-row rings)",
        f"  dropped region   {dec} decoder rings = {s['dropped_swa_bytes']:,} B, "
        f"KV-source tails {s['compression_bytes']:,} B",
        f"  slot total       {s['bytes']:,} B",
        f"block ledger ({b['tokens']} tokens a block): {b['bytes']:,} B a block, "
        f"{b['blocks_per_gib']} blocks per GiB",
        "  per KV source: " + ", ".join(f"layer {k} {v:,} B"
                                        for k, v in b["bytes_per_source"].items())]
    if m["engram"]:
        e = m["engram"]
        lines.append(f"Engram layers {e['layers']}: tables of {e['table_rows']} rows x "
                     f"{e['head_dim']} = {e['table_bytes_fp8']:,} B as FP8 (read from the "
                     f"checkpoint); per sequence nothing but its last {e['tokens_kept']} tokens")
    if rep["memory"]:
        mem = rep["memory"]
        lines.append(f"memory {mem['budget']:,} B: {mem['slots_only']} slots if it held slots "
                     f"only; {mem['tokens_per_gib_of_blocks']:,} cached tokens per GiB of blocks")
    return "\n".join(lines)
