"""`kvmesh engine layout`: a RuntimeLayout as a dict (for --json) or a table.

Pure formatting: every number comes from the RuntimeLayout the engine itself
would build from the same flags; nothing is computed a second time here.
"""

from __future__ import annotations

import re

from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.state_layout import is_dropped_swa_layer

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """'80GiB', '512MB', '1.5GiB', '1000000' -> bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"memory budget {text!r}: use a byte count or a size like 80GiB, 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _regions(layout: RuntimeLayout) -> list[dict]:
    """The slot's tensors grouped into its contiguous regions (encoder SWA, decoder SWA,
    compression, and the MTP ring with --speculative mtp:K), in layout order."""
    cfg = layout.model
    groups: dict[str, dict] = {}
    for r in layout.block.regions():
        if r.name == "swa":
            stored = not is_dropped_swa_layer(cfg, r.layer)
            name = "encoder_swa" if stored else "decoder_swa"   # decoder = YOCO consumer
        elif r.name == "mtp":
            stored, name = False, "mtp_swa"                     # the MTP drafter's ring
        else:
            stored, name = False, "compression"
        g = groups.setdefault(name, {"name": name, "stored": stored, "offset": r.offset,
                                     "bytes": 0, "layers": [], "tensors": {}})
        assert g["offset"] + g["bytes"] == r.offset, "regions are contiguous by construction"
        g["bytes"] += r.nbytes
        if r.layer not in g["layers"]:
            g["layers"].append(r.layer)
        kind = "swa" if r.name == "mtp" else cfg.layers[r.layer]
        t = g["tensors"].setdefault(f"{r.name}:{kind}",
                                    {"shape": list(r.shape), "dtype": r.dtype, "count": 0})
        t["count"] += 1
    return list(groups.values())


def to_dict(layout: RuntimeLayout, budget: int | None = None) -> dict:
    cfg, eng, sb = layout.model, layout.engine, layout.block
    kinds = sorted({cfg.layers[i] for i in cfg.compressed_layers})
    out = {
        "preset": cfg.name,
        "model": {"layers": cfg.n_layers, "encoder_layers": cfg.n_encoder_layers,
                  "window": cfg.window, "block_size": cfg.block_size,
                  "swa_bytes_per_token": cfg.swa_bytes_per_token},
        "engine": {"truncation": eng.truncation, "keep_tokens": eng.keep_tokens,
                   "extra_state": eng.extra_state, "extra_state_size": eng.extra_state_size,
                   "max_backtrack": eng.max_backtrack, "num_slots": eng.num_slots,
                   "num_blocks": eng.num_blocks, "snapshot_bytes": eng.snapshot_bytes},
        "rings": {"inference_swa": layout.inference_ring, "kvstore_swa": layout.kvstore_ring,
                  "kvstore_swa_terms": list(layout.kvstore_terms), "slot_swa": layout.slot_ring,
                  "compression": {k: layout.compress_ring(cfg.csa_m if k == "csa" else cfg.hca_m)
                                  for k in kinds}},
        "slot": {"bytes": sb.slot_bytes, "stored_bytes": sb.stored_bytes,
                 "state_size_to_disk": sb.state_size_to_disk,
                 "replica_bytes": layout.replica_bytes, "total_bytes": layout.slot_total_bytes,
                 "regions": _regions(layout)},
        "block": {"tokens": cfg.block_size, "bytes": layout.block_bytes},
        "configured": {"slots": layout.num_slots, "blocks": layout.num_blocks,
                       "tokens": layout.num_blocks * cfg.block_size, "bytes": layout.cache_bytes},
        "snapshot_store": {"bytes": eng.snapshot_bytes, "snapshots": layout.snapshots_in_store},
        "memory": None,
    }
    if budget is not None:
        fit = layout.fit(budget)
        out["memory"] = {"budget": fit.budget, "slots": fit.slots, "max_slots": fit.max_slots,
                         "blocks": fit.blocks, "tokens": fit.blocks * cfg.block_size,
                         "spare": fit.spare}
    return out


def _n(x: int) -> str:
    return f"{x:,}"


def _size(x: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x} B"


def table(d: dict) -> str:
    m, e, r, s = d["model"], d["engine"], d["rings"], d["slot"]
    keep = f", KEEP {e['keep_tokens']}" if e["truncation"] != "off" else ""
    extra = f"on (EXTRA {e['extra_state_size']})" if e["extra_state"] else "off"
    terms = r["kvstore_swa_terms"]
    kv = str(r["kvstore_swa"]) + (" = " + " + ".join(map(str, terms)) if len(terms) > 1 else "")
    rows = [("inference SWA (W + B)", str(r["inference_swa"])),
            ("kvstore SWA = slot ring", kv)]
    rows += [(f"compression {k} (m + B)", str(v)) for k, v in r["compression"].items()]
    lines = [
        f"preset {d['preset']}: {m['layers']} layers ({m['encoder_layers']} encoder), "
        f"W {m['window']}, block {m['block_size']} tokens, {m['swa_bytes_per_token']} B per SWA row",
        f"engine: truncation {e['truncation']}{keep}, extra-state {extra}, B {e['max_backtrack']}",
        "",
        f"{'ring':<28}rows",
        *(f"  {a:<26}{b}" for a, b in rows),
        "",
        f"{'slot region':<28}{'offset':>12}{'bytes':>13}  layers",
    ]
    for g in s["regions"]:
        label = ("stored: " if g["stored"] else "dropped: ") + g["name"]
        lines.append(f"  {label:<26}{_n(g['offset']):>12}{_n(g['bytes']):>13}  {len(g['layers'])}")
    lines += [
        f"  {'slot total':<38}{_n(s['bytes']):>13}",
        f"  {'state_size_to_disk':<38}{_n(s['state_size_to_disk']):>13}  (snapshot: inference ring)",
        f"  {'decode replica':<38}{_n(s['replica_bytes']):>13}",
        "",
        f"block: {d['block']['tokens']} tokens, {_n(d['block']['bytes'])} B",
        f"configured: {d['configured']['slots']} slots + {_n(d['configured']['blocks'])} blocks "
        f"= {_n(d['configured']['bytes'])} B ({_size(d['configured']['bytes'])})",
        f"snapshot store: {_size(d['snapshot_store']['bytes'])} holds "
        f"{_n(d['snapshot_store']['snapshots'])} snapshots",
    ]
    mem = d["memory"]
    if mem is not None:
        lines.append(f"memory {_size(mem['budget'])}: {mem['slots']} slots + {_n(mem['blocks'])} "
                     f"blocks ({_n(mem['tokens'])} tokens), {_n(mem['spare'])} B spare; "
                     f"slots alone: {_n(mem['max_slots'])}")
    return "\n".join(lines)
