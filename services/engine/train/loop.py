"""The training loop: AdamW, warmup + cosine, seeded, resumable, safetensors out.

One process owns everything here. The run directory holds:
    state.pt            weights + optimizer + step + data RNG + elapsed time (resume)
    model.safetensors   the weights as the engine loads them (services.engine.model.weights)
    train.log           the progress lines (also printed)

Determinism: the weights come from `init_weights(cfg, seed)`; the data offsets from a
torch.Generator seeded with `seed + 1` whose state is checkpointed, so a resumed run
draws the same batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.engine.config import ModelConfig, preset
from services.engine.model import weights as weights_mod
from services.engine.train import data
from services.engine.train.model import forward

# Fields that must agree between a run and the state it resumes from.
RESUME_KEYS = ("preset", "seed", "batch", "seq_len", "steps", "lr", "warmup", "chunk", "decay_by_time")


@dataclass
class TrainArgs:
    out: str = "runs/tiny"
    preset: str = "tiny"
    steps: int = 1000
    batch: int = 2
    seq_len: int = 1024
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    kl_weight: float = 1.0
    seed: int = 0
    chunk: int = 64                   # measured fastest on CPU (W + 64 keys per query chunk)
    bf16: bool = True
    threads: int = 1
    log_every: int = 5
    eval_every: int = 100
    eval_windows: int = 4
    ckpt_minutes: float = 5.0
    time_budget_min: float = 0.0      # 0 = no limit; otherwise stop and save when reached
    decay_by_time: bool = False       # cosine progress = max(step, elapsed time) fraction
    resume: bool = False


def initial_weights(cfg: ModelConfig, seed: int):
    """`init_weights` with the residual-branch outputs (wo, w2) scaled by 1/sqrt(2 L), so the
    residual stream starts at the embedding's scale however deep the model is."""
    w = weights_mod.init_weights(cfg, seed)
    damp = 1.0 / math.sqrt(2 * cfg.n_layers)
    for name in w:
        if name.endswith((".wo", ".w2")):
            w[name] = w[name] * damp
    return w


def lr_at(step: int, a: TrainArgs, elapsed: float = 0.0) -> float:
    """Linear warm-up, then cosine to min_lr_frac * lr. With `decay_by_time` and a time
    budget the cosine follows whichever is further along, the steps or the budget, so a
    run stopped by its budget on a slow (shared) machine still ends annealed."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    if a.decay_by_time and a.time_budget_min:
        frac = max(frac, min(1.0, elapsed / (a.time_budget_min * 60)))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(w, a: TrainArgs):
    decay = [t for k, t in w.items() if t.dim() == 2]
    rest = [t for k, t in w.items() if t.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=a.lr, betas=(0.9, 0.95), eps=1e-8)


def batch_loss(w, cfg: ModelConfig, batch, a: TrainArgs):
    """-> (total loss for backward, LM loss in nats/token, indexer KL per query)."""
    inp, tgt = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        logits, kl = forward(w, cfg, inp, chunk=a.chunk)
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    n_csa = max(1, len(cfg.csa_layers))
    kl = kl.float() / (tgt.numel() * n_csa)
    return lm + a.kl_weight * kl, lm, kl


@torch.no_grad()
def eval_loss(w, cfg: ModelConfig, windows, chunk: int, bf16: bool = False, quantize: bool = False) -> float:
    """Mean nats/token over every target of `windows` [n, T+1], one window at a time."""
    total, count = 0.0, 0
    for row in windows:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, _ = forward(w, cfg, row[None, :-1], chunk=chunk, quantize=quantize)
        total += float(F.cross_entropy(logits.float()[0], row[1:], reduction="sum"))
        count += row.numel() - 1
    return total / count


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(run: Path, w, opt, step: int, gen, elapsed: float, a: TrainArgs, cfg, history):
    _atomic_save({"weights": {k: t.detach().clone() for k, t in w.items()}, "opt": opt.state_dict(),
                  "step": step, "gen": gen.get_state(), "torch_rng": torch.get_rng_state(),
                  "elapsed": elapsed, "args": asdict(a), "config": cfg.to_json(),
                  "history": history}, run / "state.pt")
    save_model(run, w, cfg)


def save_model(run: Path, w, cfg) -> None:
    """run/model.safetensors, replaced whole (a crash leaves the previous one)."""
    tmp = run / "model.safetensors.tmp"
    weights_mod.save({k: t.detach() for k, t in w.items()}, cfg, tmp)
    os.replace(tmp, run / "model.safetensors")


class _Log:
    """Progress lines to stdout and run/train.log (owned by the loop)."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.f.write(line + "\n")


def train(a: TrainArgs) -> dict:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = preset(a.preset)
    if a.seq_len % a.chunk:
        raise ValueError(f"seq_len {a.seq_len} must be a multiple of chunk {a.chunk}")
    run = Path(a.out)
    run.mkdir(parents=True, exist_ok=True)
    log = _Log(run / "train.log")
    corpus = data.load_corpus()
    log(f"corpus {corpus.describe()}")
    val = data.eval_windows(corpus.val, a.eval_windows, a.seq_len)

    w = {k: t.requires_grad_(True) for k, t in initial_weights(cfg, a.seed).items()}
    opt = make_optimizer(w, a)
    gen = torch.Generator().manual_seed(a.seed + 1)
    step, elapsed, history = 0, 0.0, []
    state_path = run / "state.pt"
    if a.resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        diffs = [k for k in RESUME_KEYS if st["args"].get(k, False) != getattr(a, k)]
        if diffs:
            detail = ", ".join(f"{k} {st['args'].get(k)!r} vs {getattr(a, k)!r}" for k in diffs)
            raise ValueError(f"cannot resume {state_path}: {detail}")
        with torch.no_grad():
            for k, t in w.items():
                t.copy_(st["weights"][k])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        step, elapsed, history = st["step"], st["elapsed"], st["history"]
        log(f"resumed from {state_path} at step {step} ({elapsed / 60:.1f} min trained)")
    n_params = sum(t.numel() for t in w.values())
    log(f"model {cfg.name}: {n_params:,} parameters; {json.dumps(asdict(a), sort_keys=True)}")

    t_start, last_ckpt = time.monotonic(), time.monotonic()
    base_elapsed, win_tokens, win_t = elapsed, 0, time.monotonic()
    tokens_per_step = a.batch * a.seq_len
    while step < a.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a, elapsed)
        batch = data.sample_batch(corpus.train, a.batch, a.seq_len, gen)
        loss, lm, kl = batch_loss(w, cfg, batch, a)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), a.clip)
        opt.step()
        step += 1
        win_tokens += tokens_per_step
        elapsed = base_elapsed + time.monotonic() - t_start
        if step % a.log_every == 0 or step == a.steps:
            now = time.monotonic()
            tps = win_tokens / max(1e-9, now - win_t)
            win_tokens, win_t = 0, now
            eta = (a.steps - step) * tokens_per_step / max(tps, 1e-9) / 60
            pct = 100 * step / a.steps
            bar = "#" * int(pct / 5) + "." * (20 - int(pct / 5))
            log(f"[{bar}] step {step}/{a.steps} loss {lm.item():.4f} ({lm.item() / math.log(2):.3f} bits/byte) "
                f"kl {kl.item():.3f} lr {opt.param_groups[0]['lr']:.2e} {tps:.0f} tok/s "
                f"{elapsed / 60:.1f} min, eta {eta:.1f} min")
            history.append({"step": step, "loss": round(lm.item(), 5), "kl": round(kl.item(), 5),
                            "tokens": step * tokens_per_step, "minutes": round(elapsed / 60, 2)})
        if step % a.eval_every == 0 or step == a.steps:
            vl = eval_loss(w, cfg, val, a.chunk, bf16=a.bf16)
            log(f"eval step {step}: held-out loss {vl:.4f} nats/byte ({vl / math.log(2):.3f} bits/byte)")
            history.append({"step": step, "val_loss": round(vl, 5)})
        over_budget = a.time_budget_min and elapsed >= a.time_budget_min * 60
        if time.monotonic() - last_ckpt >= a.ckpt_minutes * 60 or step == a.steps or over_budget:
            save_checkpoint(run, w, opt, step, gen, elapsed, a, cfg, history)
            last_ckpt = time.monotonic()
            log(f"checkpoint step {step} -> {run / 'model.safetensors'}")
        if over_budget:
            log(f"time budget of {a.time_budget_min} min reached at step {step}: stopping")
            break
    return {"step": step, "tokens": step * tokens_per_step, "minutes": elapsed / 60}
