"""Encoder bounded replay against an independent plain-torch implementation.

The reference below is written for this test from the formula, not from the
engine's code: tokens [s, T) run through the encoder with SWA query i seeing
keys [max(s, i - W + 1), i]; compressed entries of groups before L1 come from
the cache (the first request's cold pass), later ones from the replayed rows;
decoder layers run from dec_lo = L - KEEP with keys from dec_lo on.
"""

import math

import torch

from kernels import mxfp8
from kvmesh import cachekeys as hashing
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import ops, reference
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()
KEEP = 22


def topk_lowest_index_ties(scores, k):
    order = sorted(range(len(scores)), key=lambda j: (-float(scores[j]), j))
    return order[:k]


def attend(q, keys, sink, scale):
    """q [H, D], keys [K, D] -> [H, D]; one softmax with the sink in the denominator."""
    logits = torch.cat([(q @ keys.T) * scale, sink.unsqueeze(1)], dim=1)
    p = torch.softmax(logits, dim=1)[:, :-1]
    return p @ keys


def layer(w, layer_id, x, pos, lo, src, src_pos, cached, cached_idx, l1):
    cfg, p = CFG, f"layers.{layer_id}."
    h = ops.rms_norm(x, w[p + "attn_norm"], cfg.norm_eps)
    q, kv = ops.query_and_kv(w, layer_id, h, pos, cfg)
    kv = mxfp8.dequantize(mxfp8.quantize(kv), kv.dtype)
    m = cfg.compress_ratio(layer_id)
    entries = idx_keys = None
    if m is not None:
        src = h if src is None else src
        new_from = (l1 - int(src_pos[0])) if l1 > int(src_pos[0]) else 0
        rows = src[new_from:]
        g = len(rows) // m
        v, z = ops.compressor_inputs(w, layer_id, rows[: g * m])
        new = ops.pool_entries(w, layer_id, v, z, l1 // m, m, cfg)
        entries = torch.cat([cached[: l1 // m], new])
        if cfg.layers[layer_id] == "csa":
            iv, iz = ops.indexer_inputs(w, layer_id, rows[: g * m])
            idx_keys = torch.cat([cached_idx[: l1 // m], ops.pool_index_keys(w, layer_id, iv, iz, m)])
    out = torch.zeros_like(q)
    scale = 1 / math.sqrt(cfg.head_dim)
    for t, i in enumerate(pos.tolist()):
        lo_i = max(lo, i - cfg.window + 1)
        keys = kv[[r for r, j in enumerate(pos.tolist()) if lo_i <= j <= i]]
        if m is not None:
            visible = (i + 1) // m
            if cfg.layers[layer_id] == "csa":
                iq, iw = ops.index_query(w, layer_id, h[t], cfg)
                scores = (idx_keys[:visible] @ iq.T).relu() @ iw
                picks = sorted(topk_lowest_index_ties(scores, cfg.csa_topk))
                keys = torch.cat([keys, entries[picks]])
            else:
                keys = torch.cat([keys, entries[:visible]])
        out[t] = attend(q[t], keys, w[p + "sink"], scale)
    x = x + ops.attn_output(w, layer_id, out)
    return x + ops.ffn(w, layer_id, x, cfg)


def replay_reference(w, first_pass, tokens, s, l1, dec_lo):
    cfg = CFG
    pos = torch.arange(s, len(tokens))
    x = w["embed"][torch.tensor(tokens[s:])]
    for lid in range(cfg.n_encoder_layers):
        x = layer(w, lid, x, pos, s, None, pos, first_pass.entries.get(lid),
                  first_pass.index_keys.get(lid), l1)
    h_enc = ops.encoder_output(w, x, cfg)
    keep = pos >= dec_lo
    xd, posd = x[keep], pos[keep]
    for lid in range(cfg.n_encoder_layers, cfg.n_layers):
        xd = layer(w, lid, xd, posd, dec_lo, h_enc, pos, first_pass.entries.get(lid),
                   first_pass.index_keys.get(lid), l1)
    return ops.logits(w, xd, cfg)


def test_bounded_replay_matches_independent_formula_and_keeps_entries():
    first = random_prompt(150, 11)
    second = first[:112] + random_prompt(40, 12)      # cap 152 - 22 = 130 -> L1 = 112
    engine = make_engine(CFG, truncation="compact", keep_tokens=KEEP, swa_policy="zero",
                         max_batched_tokens=64)
    a = engine.add_request(first, SamplingParams(temperature=0, max_tokens=1))
    run_to_completion(engine)
    hashes = hashing.chain(first, CFG.block_size, CFG.fingerprint())
    block6 = engine.cache.pool.lookup(hashes[6])
    assert block6 is not None and a.finished
    before = engine.cache.store.serialize(block6)     # entries of tokens [96, 112)
    b = engine.add_request(second, SamplingParams(temperature=0, max_tokens=6))
    run_to_completion(engine)
    assert (b.cached_tokens, b.replayed_tokens) == (112, 16)
    assert engine.counters["snapshot_misses"] == 1 and engine.counters["replayed_tokens"] == 16
    assert engine.cache.store.serialize(block6) == before, "replay must not rewrite cached entries"

    first_pass = reference.forward(engine.weights, CFG, first)
    tokens = second + b.output[:-1]
    want = replay_reference(engine.weights, first_pass, tokens, s=96, l1=112, dec_lo=152 - KEEP)
    got = torch.stack(engine.logits[b.request_id])
    want = want[len(second) - 1 - (152 - KEEP):]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-9

    # and replay is an approximation: it differs from the cold (full-window) run
    cold = reference.forward(engine.weights, CFG, tokens, dec_lo=152 - KEEP)
    assert float((cold.logits[-want.shape[0]:] - want).abs().max()) > 1e-6
