"""Measure a DeepSeek V4.1 checkpoint directory on the held-out files, code, English and the
conversations apart
(what `kvmesh train-eval DIR` prints and the model card quotes).

- held-out bits/byte: every target of non-overlapping, evenly spaced windows of `seq_len`
  tokens, the checkpoint's own forward (V41Model.logits, fp32);
- baselines on the same targets: an add-one unigram over the training split's tokens, and
  an add-one unigram over its bytes (the byte-level models' baseline);
- context beyond the window: for positions p >= 512 (every `cut_stride`th), the loss of
  token p+1 given the whole window vs given only the last W tokens (p-W+1..p, run as a
  fresh sequence). The gap is what the compressed caches carry past the sliding window;
- copying past the window (code): a 192-token snippet, a separator and the snippet again;
  the repeat's loss with everything vs with only the last W tokens (`copy_losses`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.training import data, v41_data

CUT_FROM = 512
COPY_SNIPPET = 192          # tokens per copy of the retrieval test: W + 64
COPY_ROWS = 8


def windows_of(stream: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """Up to n non-overlapping windows of seq_len + 1 tokens, evenly spaced."""
    n = min(n, len(stream) // (seq_len + 1))
    if n == 0:
        raise ValueError(f"a held-out stream of {len(stream)} tokens is shorter than one window "
                         f"of {seq_len + 1}")
    return data.eval_windows(stream, n, seq_len)


@torch.no_grad()
def position_losses(model: V41Model, windows: torch.Tensor) -> torch.Tensor:
    """[n, T] nats of target t+1 given tokens 0..t (float64, for the sums)."""
    return torch.stack([F.cross_entropy(model.logits(row[:-1]).float(), row[1:], reduction="none")
                        for row in windows.long()]).double()


@torch.no_grad()
def cut_losses(model: V41Model, windows: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """[n, len(positions)] nats of token p+1 given only the last W tokens up to p."""
    w = model.cfg.window
    return torch.tensor([[float(F.cross_entropy(model.logits(row[p - w + 1:p + 1])[-1].float(),
                                                row[p + 1]))
                          for p in positions] for row in windows.long()], dtype=torch.float64)


@torch.no_grad()
def copy_losses(model: V41Model, windows: torch.Tensor, separator: list[int],
                snippet: int, stride: int) -> dict:
    """Retrieval past the window: each row is a window's first `snippet` tokens (more than
    W), `separator`, and the same tokens again (v41_data.copy_row with s fixed). Nats per
    token on the first copy, on the repeat given everything, and on the repeat given only
    the last W tokens (every `stride`th position from W on, where the first copy is out of
    the window): the repeat is cheap only if the compressed caches carried the first copy."""
    w, sep = model.cfg.window, torch.tensor(separator)
    first, repeat, cut, full_at = [], [], [], []
    start = snippet + len(separator)                       # the repeat's first token
    for row in windows.long():
        seq = torch.cat([row[:snippet], sep, row[:snippet]])
        nats = F.cross_entropy(model.logits(seq[:-1]).float(), seq[1:], reduction="none")
        first.append(nats[: snippet - 1])
        repeat.append(nats[start:])                        # targets start + 1 .. end
        for p in range(start + w, len(seq) - 1, stride):   # target p + 1, predicted at p
            cut.append(float(F.cross_entropy(model.logits(seq[p - w + 1:p + 1])[-1].float(),
                                             seq[p + 1])))
            full_at.append(float(nats[p]))
    mean = lambda xs: float(torch.cat(xs).double().mean())  # noqa: E731
    return {"snippet_tokens": snippet, "rows": len(windows),
            "first_copy_nats_per_token": mean(first),
            "repeat_nats_per_token": mean(repeat),
            "repeat_sampled_positions": len(cut),
            "repeat_full_context_nats_per_token": sum(full_at) / len(full_at),
            "repeat_cut_to_window_nats_per_token": sum(cut) / len(cut)}


def bits_per_byte(nats: torch.Tensor, nbytes: torch.Tensor) -> float:
    """Summed nats over targets -> bits per byte of those targets (nbytes: each one's bytes)."""
    return float(nats.sum()) / math.log(2) / float(nbytes.sum())


def byte_unigram_bits(texts, windows: torch.Tensor, tok) -> float:
    """Bits/byte of the windows' target text under the add-one byte unigram of `texts`."""
    counts = torch.ones(256, dtype=torch.float64)
    for text in texts:
        raw = bytearray(text.encode())
        if raw:
            counts += torch.bincount(torch.frombuffer(raw, dtype=torch.uint8).long(),
                                     minlength=256).double()
    logp = torch.log2(counts / counts.sum())
    total, nbytes = 0.0, 0
    for row in windows.long():
        text = tok.decode(row[1:].tolist(), skip_special_tokens=False).encode()
        total -= float(logp[torch.frombuffer(bytearray(text), dtype=torch.uint8).long()].sum())
        nbytes += len(text)
    return total / nbytes


def evaluate(directory: str, windows: int = 32, seq_len: int = 1024, cut_stride: int = 32,
             threads: int = 1) -> dict:
    from tokenizers import Tokenizer

    if seq_len <= CUT_FROM:
        raise ValueError(f"seq_len must exceed {CUT_FROM} to measure context beyond the window")
    torch.set_num_threads(threads)
    cfg, weights = load_v41_checkpoint(directory, torch.float32)
    model = V41Model(cfg, weights, torch.float32)
    tok = Tokenizer.from_file(f"{directory}/tokenizer.json")
    nbytes = v41_data.token_bytes(tok)
    out = {"checkpoint": str(directory), "eval_seq_len": seq_len}
    for kind, (root, files) in v41_data.sources().items():
        train_files, val_files = data.split(files)
        train = v41_data.encode(tok, root, train_files, kind)
        val = v41_data.encode(tok, root, val_files, kind)
        win = windows_of(val, windows, seq_len)
        targets = win[:, 1:].long()
        target_bytes = nbytes[targets]
        full = position_losses(model, win)
        counts = torch.bincount(train.long(), minlength=cfg.vocab_size).double() + 1.0
        unigram_nats = -torch.log(counts / counts.sum())[targets]
        positions = list(range(CUT_FROM, seq_len, cut_stride))
        cut = cut_losses(model, win, positions)
        full_at, bytes_at = full[:, positions], target_bytes[:, positions]
        diff = (cut - full_at).reshape(-1)
        out[kind] = {
            "train_files": len(train_files), "held_out_files": len(val_files),
            "train_tokens": len(train), "held_out_tokens": len(val),
            "windows": len(win), "predictions": int(full.numel()),
            "bytes_per_token": float(target_bytes.mean()),
            "bits_per_byte": bits_per_byte(full, target_bytes),
            "token_unigram_bits_per_byte": bits_per_byte(unigram_nats, target_bytes),
            "byte_unigram_bits_per_byte": byte_unigram_bits(
                v41_data.texts(root, train_files, kind), win, tok),
            "beyond_window": {
                "positions": f"{CUT_FROM}..{seq_len - 1} step {cut_stride}",
                "n": int(cut.numel()),
                "full_context_bits_per_byte": bits_per_byte(full_at, bytes_at),
                "cut_to_window_bits_per_byte": bits_per_byte(cut, bytes_at),
                "gap_bits_per_byte": bits_per_byte(diff, bytes_at),
                "gap_stderr_bits_per_byte": float(diff.std() / math.sqrt(diff.numel()))
                                            / math.log(2) / float(bytes_at.mean()),
            },
        }
        if kind == "code":
            sep = tok.encode(v41_data.COPY_SEPARATOR, add_special_tokens=False).ids
            out[kind]["copy"] = copy_losses(model, win[:COPY_ROWS], sep, COPY_SNIPPET, 8)
    return out
