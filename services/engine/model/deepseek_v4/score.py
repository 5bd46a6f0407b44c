"""Scoring a sequence with the full forward: what `kvmesh score` prints.

logprobs[i] is log-softmax of position i-1's logits at ids[i] (none for the first id);
argmax[i] is the most likely next id after position i. Users check a checkpoint, or a
quantization of it, against another implementation with these numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvmesh.checkpoint_dir import is_v41
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint, load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.config import V4Config
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model


def load_model(directory: str | Path, dtype: torch.dtype, split=None) -> V4Model | V41Model:
    """The checkpoint's full forward: DeepSeek V4's, or V4.1's by config.json's model_type;
    given a split (parallel.Split, its process group started), this rank's share of it."""
    if split is not None:
        from kvmesh.services.engine.model.deepseek_v4.parallel import (
            Groups,
            ParallelV4Model,
            ParallelV41Model,
        )
    if is_v41(directory):
        cfg41, weights = load_v41_checkpoint(directory, dtype, split)
        if split is not None:
            return ParallelV41Model(cfg41, weights, dtype, split, Groups(split))
        return V41Model(cfg41, weights, dtype)
    cfg, weights = load_checkpoint(directory, dtype, split)
    if split is not None:
        return ParallelV4Model(cfg, weights, dtype, split, Groups(split))
    return V4Model(cfg, weights, dtype)


def check_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError naming `ids` unless they are a non-empty run of the vocabulary's ids."""
    if not ids:
        raise ValueError("ids: need at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids: {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")


def score(model: V4Model | V41Model, ids: list[int]) -> dict:
    check_ids(ids, model.cfg.vocab_size)
    logits = model.logits(torch.tensor(ids))
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    at = torch.tensor(ids[1:], device=logprobs.device).view(-1, 1)
    picked = logprobs[:-1].gather(1, at).view(-1).tolist()
    return {"ids": list(ids), "logprobs": [None, *picked],
            "argmax": logits.argmax(dim=-1).tolist()}


def perplexity(result: dict) -> float:
    lps = [lp for lp in result["logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps)) if lps else float("nan")


def tokenize(directory: str | Path, text: str, cfg: V4Config | V41Config) -> list[int]:
    """The text through the checkpoint's tokenizer.json, begin-of-sentence first when the
    config names one."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file (pass --ids, or add the tokenizer)")
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: not a tokenizers file ({exc})") from None
    if tok.get_vocab_size() > cfg.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tok.get_vocab_size()} tokens, more "
                              f"than the model's vocab_size {cfg.vocab_size}")
    ids = tok.encode(text, add_special_tokens=False).ids
    return ([cfg.bos_token_id] if cfg.bos_token_id is not None else []) + ids
