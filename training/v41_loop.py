"""`kvmesh train`: train the shipped DeepSeek V4.1 model (v41_model.py) on code and
English and conversations (v41_data.py) with the shared step loop (steps.run_steps: AdamW, warm-up + cosine,
progress with an ETA, held-out evaluations, a time budget, resumable checkpoints).

The run directory is a Hugging Face checkpoint directory at every checkpoint:
    config.json, model.safetensors   the model as `load_v41_checkpoint` reads it (bf16,
                                     the release's names, one tensor per expert)
    tokenizer.json, tokenizer_config.json   copied from --tokenizer
    state.pt                         fp32 weights, optimizer, step, RNG states (resume)
    tokens.pt                        the tokenized corpus (a cache)
    train.log                        the progress lines
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.v41_config import v41_config_from_dict
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.training import data, v41_data
from kvmesh.training.steps import (
    Log,
    StepArgs,
    make_optimizer,
    restore,
    resume_from,
    run_steps,
    save_state,
)
from kvmesh.training.v41_evaluate import bits_per_byte, position_losses
from kvmesh.training.v41_model import balance, forward, initial_weights, shipped_config

RESUME_KEYS = ("seed", "batch", "seq_len", "steps", "lr", "warmup", "decay_by_time",
               "english_fraction", "chat_fraction", "copy_fraction", "init_from")


@dataclass
class V41StepArgs(StepArgs):
    """What both V4.1 training commands (`train`, `train-mtp`) default alike."""
    batch: int = 1
    lr: float = 2e-3
    warmup: int = 50
    log_every: int = 10
    eval_every: int = 200
    english_fraction: float = 0.2
    chat_fraction: float = 0.1


@dataclass
class V41TrainArgs(V41StepArgs):
    out: str = "runs/v41-tiny"
    steps: int = 4000
    tokenizer: str = ""
    init_from: str = ""
    kl_weight: float = 1.0
    balance_rate: float = 1e-2
    copy_fraction: float = 0.0


def step_loss(model: V41Model, rows: list[torch.Tensor], kl_weight: float):
    """Mean over the rows of (LM loss + kl_weight * indexer KL) -> (loss, LM nats/token, KL,
    expert loads per layer summed over the rows)."""
    total, lm_sum, kl_sum, loads = 0.0, 0.0, 0.0, None
    for row in rows:
        out = forward(model, row[:-1].long())
        lm = F.cross_entropy(out.logits.float(), row[1:].long())
        total = total + (lm + kl_weight * out.indexer_kl) / len(rows)
        lm_sum, kl_sum = lm_sum + lm.item(), kl_sum + out.indexer_kl.item()
        loads = out.loads if loads is None else [a + b for a, b in zip(loads, out.loads, strict=True)]
    return total, lm_sum / len(rows), kl_sum / len(rows), loads


def save_hf(directory: Path, raw_config: dict, weights: dict[str, torch.Tensor],
            dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json and model.safetensors as DeepSeek's release names them (experts one by
    one), replaced whole (a crash leaves the previous pair)."""
    from safetensors.torch import save_file

    stored = {}
    for name, value in weights.items():
        value = value.detach()
        if name.endswith("experts.w13"):
            base, inter = name[:-len("w13")], value.shape[1] // 2
            for e in range(value.shape[0]):
                stored[f"{base}{e}.w1.weight"] = value[e, :inter]
                stored[f"{base}{e}.w3.weight"] = value[e, inter:]
        elif name.endswith("experts.w2"):
            for e in range(value.shape[0]):
                stored[f"{name[:-len('w2')]}{e}.w2.weight"] = value[e]
        else:
            stored[name] = value
    stored = {k: v.to(dtype).contiguous() for k, v in stored.items()}
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file(stored, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / "model.safetensors")
    config = {**raw_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def starting_weights(cfg, a: V41TrainArgs, log) -> dict[str, torch.Tensor]:
    """--init-from DIR's weights (a checkpoint directory of this same shape: a second phase
    with its own schedule and a fresh optimizer), else `initial_weights`."""
    if not a.init_from:
        return initial_weights(cfg, a.seed)
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint

    given, w = load_v41_checkpoint(a.init_from, torch.float32)
    if given != cfg:
        raise ValueError(f"--init-from {a.init_from}: its config differs from the model this "
                         "run trains")
    log(f"weights from {a.init_from}")
    return {k: t.contiguous() for k, t in w.items()}


def train_v41(a: V41TrainArgs) -> dict:
    from tokenizers import Tokenizer

    if not a.tokenizer or not (Path(a.tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {a.tokenizer!r}: expected a directory holding "
                         "tokenizer.json (kvmesh train-tokenizer writes one)")
    shares = (a.english_fraction, a.chat_fraction, a.copy_fraction)
    if min(shares) < 0 or sum(shares) > 1:
        raise ValueError(f"--english-fraction {a.english_fraction}, --chat-fraction "
                         f"{a.chat_fraction}, --copy-fraction {a.copy_fraction}: expected "
                         "shares >= 0 adding up to at most 1")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    run = Path(a.out)
    run.mkdir(parents=True, exist_ok=True)
    log = Log(run / "train.log")
    tok = Tokenizer.from_file(str(Path(a.tokenizer) / "tokenizer.json"))
    if Path(a.tokenizer).resolve() != run.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(a.tokenizer) / name, run / name)
    raw = shipped_config(vocab_size=tok.get_vocab_size())
    cfg = v41_config_from_dict(raw)
    corpus = v41_data.load(tok, run / "tokens.pt")
    log(f"corpus {corpus.describe()}")
    nbytes = v41_data.token_bytes(tok)
    val = {kind: data.eval_windows(corpus.val[kind], a.eval_windows, a.seq_len)
           for kind in v41_data.KINDS}

    w = {k: t.requires_grad_(True) for k, t in starting_weights(cfg, a, log).items()}
    trained = {k: t for k, t in w.items() if not k.endswith("gate.bias")}   # bias: `balance`
    opt = make_optimizer(trained, a)
    gen = torch.Generator().manual_seed(a.seed + 1)
    st, resumed = resume_from(a, run, RESUME_KEYS, opt, gen, log)
    if st is not None:
        restore(st, w)
    model = V41Model(cfg, w, torch.float32)
    log(f"model deepseek_v41: {sum(t.numel() for t in w.values()):,} parameters; "
        f"{json.dumps(asdict(a), sort_keys=True)}")

    # copy rows: snippets longer than the window by a block's worth of entries
    copy = (tok.encode(v41_data.COPY_SEPARATOR, add_special_tokens=False).ids, cfg.window + 16)

    def one_step():
        rows = v41_data.sample(corpus, a.batch, a.seq_len, a.english_fraction, a.chat_fraction,
                               gen, a.copy_fraction, copy)
        loss, lm, kl, loads = step_loss(model, rows, a.kl_weight)
        balance(w, cfg, loads, a.balance_rate)
        spread = max(float(x.max()) / max(float(x.float().mean()), 1e-9) for x in loads)
        return loss, lambda: (f"loss {lm:.4f} nats/token kl {kl:.3f} max/mean load {spread:.2f}",
                              {"loss": round(lm, 5), "kl": round(kl, 5),
                               "max_load": round(spread, 3)})

    def evaluate():
        bits = {kind: bits_per_byte(position_losses(model, val[kind]), nbytes[val[kind][:, 1:]])
                for kind in v41_data.KINDS}
        return (" ".join(f"{k} {v:.3f} bits/byte" for k, v in bits.items()),
                {f"val_{k}_bits_per_byte": round(v, 4) for k, v in bits.items()})

    def save(step, elapsed, history):
        save_state(run, w, opt, gen, step, elapsed, asdict(a), history)
        save_hf(run, raw, w)

    return run_steps(a, opt, list(trained.values()), resumed, one_step, evaluate, save, log)
