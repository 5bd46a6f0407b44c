"""The training corpus: the running interpreter's standard library, as bytes.

Every `.py` file under the stdlib directory (site-packages excluded), sorted by
relative path. A file is held out for validation iff the first 8 bytes of the
SHA-256 of its relative path, as an integer, are < 3 % of 2**64: the split
depends only on each file's own name, so it is stable across Python versions
that add or remove other files, and it is never trained on.

Token stream: each file's UTF-8 bytes followed by EOS (257), files in sorted
order. Samples are random windows of that stream (the model sees file ends and
learns to emit EOS).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.tokenizer import ByteTokenizer

HELD_OUT_PERCENT = 3
MIN_HELD_OUT_FRACTION = 0.02


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the stdlib's .py files, sorted."""
    root = root or stdlib_root()
    return sorted(p.relative_to(root) for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and p.is_file())


def is_held_out(rel: Path) -> bool:
    digest = hashlib.sha256(rel.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT_PERCENT * (1 << 64) // 100


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    train = [f for f in files if not is_held_out(f)]
    val = [f for f in files if is_held_out(f)]
    if len(val) < MIN_HELD_OUT_FRACTION * len(files):
        raise ValueError(f"held-out split too small: {len(val)} of {len(files)} files")
    return train, val


def token_stream(root: Path, files: list[Path]) -> torch.Tensor:
    """int16 [n]: bytes of each file then EOS."""
    eos = torch.tensor([ByteTokenizer.EOS], dtype=torch.int16)
    parts = []
    for rel in files:
        data = (root / rel).read_bytes()
        if data:
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        parts.append(eos)
    return torch.cat(parts)


@dataclass
class Corpus:
    root: Path
    train_files: list[Path]
    val_files: list[Path]
    train: torch.Tensor
    val: torch.Tensor

    def describe(self) -> str:
        return (f"{self.root}: {len(self.train_files)} train files ({len(self.train):,} tokens), "
                f"{len(self.val_files)} held-out files ({len(self.val):,} tokens)")


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    train_files, val_files = split(stdlib_files(root))
    return Corpus(root, train_files, val_files,
                  token_stream(root, train_files), token_stream(root, val_files))


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] long windows at random offsets (inputs are [:, :-1], targets [:, 1:])."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for seq_len {seq_len}")
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()


def eval_windows(stream: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len + 1] evenly spaced, deterministic windows of the held-out stream."""
    span = len(stream) - seq_len - 1
    if span < 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is too short for seq_len {seq_len}")
    starts = [(i * span) // max(1, n - 1) for i in range(n)] if n > 1 else [0]
    return torch.stack([stream[s : s + seq_len + 1] for s in starts]).long()


def unigram_bits(train: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    """Cross-entropy in bits/token of `targets` under the add-one byte-unigram of `train`."""
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1.0
    logp = torch.log2(counts / counts.sum())
    return float(-logp[targets.reshape(-1)].mean())
