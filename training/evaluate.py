"""Measure a checkpoint on the held-out stdlib files.

- held-out loss: mean nats/byte over `windows` evenly spaced windows of `seq_len`
  tokens (every target of every window), fp32, SWA KV unquantized and, separately,
  MXFP8-quantized as the engine serves it;
- byte-unigram baseline: add-one unigram of the training stream on the same targets;
- context beyond the window: for positions p >= 512 (every `cut_stride`th), the loss
  of token p+1 given the whole window (up to 1,024 tokens) vs given only the last
  128 tokens (p-127..p, run as a fresh 128-token sequence). The gap is what the
  compressed branches carry beyond the 128-token sliding window;
- a small fixed slice (2 windows of 512 tokens) whose loss the shipped-checkpoint
  test checks in seconds.
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from services.engine.config import preset
from services.engine.model import weights as weights_mod
from training import data
from training.model import forward

CUT_CONTEXT = 128
CUT_FROM = 512
SLICE = (2, 512)      # (windows, seq_len) of the quick check


@torch.no_grad()
def position_losses(w, cfg, windows, quantize: bool = False):
    """[n, T] loss of target t+1 given tokens 0..t, each window run on its own."""
    rows = []
    for row in windows:
        logits, _ = forward(w, cfg, row[None, :-1], chunk=cfg.window, quantize=quantize)
        rows.append(F.cross_entropy(logits[0], row[1:], reduction="none"))
    return torch.stack(rows)


@torch.no_grad()
def cut_context_losses(w, cfg, windows, positions, batch: int = 32):
    """[n, len(positions)] loss of token p+1 given only tokens p-127..p."""
    ctx = torch.stack([row[p - CUT_CONTEXT + 1 : p + 1] for row in windows for p in positions])
    tgt = torch.stack([row[p + 1] for row in windows for p in positions])
    out = []
    for i in range(0, len(ctx), batch):
        logits, _ = forward(w, cfg, ctx[i : i + batch], chunk=cfg.window)
        out.append(F.cross_entropy(logits[:, -1], tgt[i : i + batch], reduction="none"))
    return torch.cat(out).view(len(windows), len(positions))


def slice_loss(w, cfg, val_stream) -> float:
    return float(position_losses(w, cfg, data.eval_windows(val_stream, *SLICE)).mean())


def held_out_stream(root=None):
    """Only the held-out files' stream (what the quick shipped-checkpoint check reads)."""
    root = root or data.stdlib_root()
    _, val_files = data.split(data.stdlib_files(root))
    return data.token_stream(root, val_files)


def evaluate(checkpoint: str, preset_name: str = "tiny", windows: int = 32, seq_len: int = 1024,
             cut_stride: int = 32, threads: int = 1) -> dict:
    if seq_len <= CUT_FROM:
        raise ValueError(f"seq_len must exceed {CUT_FROM} to measure context beyond the window")
    torch.set_num_threads(threads)
    cfg = preset(preset_name)
    w = weights_mod.load(checkpoint, cfg)
    corpus = data.load_corpus()
    val = data.eval_windows(corpus.val, windows, seq_len)
    full = position_losses(w, cfg, val)
    mxfp8 = position_losses(w, cfg, val, quantize=True)
    positions = list(range(CUT_FROM, seq_len, cut_stride))
    cut = cut_context_losses(w, cfg, val, positions)
    full_at = full[:, positions]
    ln2 = math.log(2)
    val_loss = float(full.mean())
    return {
        "checkpoint": str(checkpoint),
        "held_out_files": len(corpus.val_files),
        "train_files": len(corpus.train_files),
        "train_tokens": len(corpus.train),
        "eval_windows": windows,
        "eval_seq_len": seq_len,
        "eval_tokens": int(full.numel()),
        "val_loss_nats": val_loss,
        "val_bits_per_byte": val_loss / ln2,
        "val_bits_per_byte_mxfp8": float(mxfp8.mean()) / ln2,
        "unigram_bits_per_byte": data.unigram_bits(corpus.train, val[:, 1:], cfg.vocab_size),
        "beyond_window": {
            "positions": f"{CUT_FROM}..{seq_len - 1} step {cut_stride}",
            "n": int(cut.numel()),
            "full_context_nats": float(full_at.mean()),
            "cut_to_128_nats": float(cut.mean()),
            "gap_nats": float(cut.mean() - full_at.mean()),
            # the gap's standard error over the positions measured
            "gap_stderr_nats": float((cut - full_at).std() / math.sqrt(cut.numel())),
        },
        "slice": {"windows": SLICE[0], "seq_len": SLICE[1], "loss_nats": slice_loss(w, cfg, corpus.val)},
        "config": json.loads(cfg.to_json()),
    }
