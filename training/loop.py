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
from training import data
from training.model import forward

# Fields that must agree between a run and the state it resumes from.
RESUME_KEYS = ("preset", "seed", "batch", "seq_len", "steps", "lr", "warmup", "chunk", "decay_by_time")


@dataclass
class StepArgs:
    """What every training run has (`kvmesh train`, `train-mtp`, `train-v41`; each its own
    defaults): the step loop's settings."""
    out: str = "runs/tiny"
    steps: int = 1000
    batch: int = 2
    seq_len: int = 1024
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    threads: int = 1
    log_every: int = 5
    eval_every: int = 100
    eval_windows: int = 4
    ckpt_minutes: float = 5.0
    resume: bool = False


@dataclass
class RunArgs(StepArgs):
    """A V4-mini run (`kvmesh train`, `kvmesh train-mtp`)."""
    preset: str = "tiny"
    chunk: int = 64                   # measured fastest on CPU (W + 64 keys per query chunk)
    bf16: bool = True


@dataclass
class TrainArgs(RunArgs):
    kl_weight: float = 1.0
    time_budget_min: float = 0.0      # 0 = no limit; otherwise stop and save when reached
    decay_by_time: bool = False       # cosine progress = max(step, elapsed time) fraction


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


def start_run(a):
    """What both trainers do first: threads, the seed, the preset, the chunk check, the run
    directory and its log. -> (cfg, run, log)."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = preset(a.preset)
    if a.seq_len % a.chunk:
        raise ValueError(f"seq_len {a.seq_len} must be a multiple of chunk {a.chunk}")
    run = Path(a.out)
    run.mkdir(parents=True, exist_ok=True)
    return cfg, run, _Log(run / "train.log")


def resume_from(a, run: Path, keys, opt, gen, log) -> tuple[dict | None, tuple]:
    """With --resume and a run/state.pt: check that it is this run's (the same `keys`; a key
    the saved run did not have counts as False, flags added later default to off), load the
    optimizer and data-RNG state. -> (the state, for the caller's weights, or None;
    (step, elapsed seconds, history) to go on from)."""
    path = run / "state.pt"
    if not (a.resume and path.exists()):
        return None, (0, 0.0, [])
    st = torch.load(path, weights_only=False)
    diffs = [k for k in keys if st["args"].get(k, False) != getattr(a, k)]
    if diffs:
        detail = ", ".join(f"{k} {st['args'].get(k)!r} vs {getattr(a, k)!r}" for k in diffs)
        raise ValueError(f"cannot resume {path}: {detail}")
    opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    log(f"resumed from {path} at step {st['step']} ({st['elapsed'] / 60:.1f} min trained)")
    return st, (st["step"], st["elapsed"], st["history"])


def restore(st: dict, w: dict) -> None:
    """A resumed run's weights and torch RNG state, from the state `resume_from` read."""
    with torch.no_grad():
        for k, t in w.items():
            t.copy_(st["weights"][k])
    torch.set_rng_state(st["torch_rng"])


def run_steps(a, opt, params, resumed: tuple, step_loss, evaluate, save, log) -> dict:
    """The step loop both trainers share: the learning rate of `lr_at`, backward with the
    gradient clipped, progress lines (bar, tok/s, eta) every `log_every` steps, a held-out
    evaluation every `eval_every`, a checkpoint every `ckpt_minutes`, and the time budget,
    which stops the run after one last evaluation and checkpoint.

    `resumed`: (step, elapsed seconds, history) to go on from; `step_loss()` -> (loss to
    backward, report), report() -> (progress text, history fields), called only on the steps
    that log; `evaluate()` -> (text, history fields); `save(step, elapsed, history)`."""
    step, elapsed, history = resumed
    t_start = last_ckpt = win_t = time.monotonic()
    base_elapsed, win_tokens, tokens_per_step = elapsed, 0, a.batch * a.seq_len
    while step < a.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a, elapsed)
        loss, report = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        step += 1
        win_tokens += tokens_per_step
        elapsed = base_elapsed + time.monotonic() - t_start
        if step % a.log_every == 0 or step == a.steps:
            now = time.monotonic()
            tps, win_tokens, win_t = win_tokens / max(1e-9, now - win_t), 0, now
            eta = (a.steps - step) * tokens_per_step / max(tps, 1e-9) / 60
            bar = "#" * (20 * step // a.steps) + "." * (20 - 20 * step // a.steps)
            text, fields = report()
            log(f"[{bar}] step {step}/{a.steps} {text} lr {opt.param_groups[0]['lr']:.2e} "
                f"{tps:.0f} tok/s {elapsed / 60:.1f} min, eta {eta:.1f} min")
            history.append({"step": step, **fields, "tokens": step * tokens_per_step,
                            "minutes": round(elapsed / 60, 2)})
        over = bool(a.time_budget_min) and elapsed >= a.time_budget_min * 60
        if step % a.eval_every == 0 or step == a.steps or over:
            text, fields = evaluate()
            log(f"eval step {step}: held-out {text}")
            history.append({"step": step, **fields})
        if time.monotonic() - last_ckpt >= a.ckpt_minutes * 60 or step == a.steps or over:
            save(step, elapsed, history)
            last_ckpt = time.monotonic()
            log(f"checkpoint step {step} -> {Path(a.out) / 'model.safetensors'}")
        if over:
            log(f"time budget of {a.time_budget_min} min reached at step {step}: stopping")
            break
    return {"step": step, "tokens": step * tokens_per_step, "minutes": elapsed / 60}


def train(a: TrainArgs) -> dict:
    cfg, run, log = start_run(a)
    corpus = data.load_corpus()
    log(f"corpus {corpus.describe()}")
    val = data.eval_windows(corpus.val, a.eval_windows, a.seq_len)

    w = {k: t.requires_grad_(True) for k, t in initial_weights(cfg, a.seed).items()}
    opt = make_optimizer(w, a)
    gen = torch.Generator().manual_seed(a.seed + 1)
    st, resumed = resume_from(a, run, RESUME_KEYS, opt, gen, log)
    if st is not None:
        restore(st, w)
    n_params = sum(t.numel() for t in w.values())
    log(f"model {cfg.name}: {n_params:,} parameters; {json.dumps(asdict(a), sort_keys=True)}")

    def step_loss():
        loss, lm, kl = batch_loss(w, cfg, data.sample_batch(corpus.train, a.batch, a.seq_len, gen), a)
        return loss, lambda: (
            f"loss {lm.item():.4f} ({lm.item() / math.log(2):.3f} bits/byte) kl {kl.item():.3f}",
            {"loss": round(lm.item(), 5), "kl": round(kl.item(), 5)})

    def evaluate():
        vl = eval_loss(w, cfg, val, a.chunk, bf16=a.bf16)
        return f"loss {vl:.4f} nats/byte ({vl / math.log(2):.3f} bits/byte)", {"val_loss": round(vl, 5)}

    return run_steps(a, opt, list(w.values()), resumed, step_loss, evaluate,
                     lambda step, elapsed, history: save_checkpoint(run, w, opt, step, gen, elapsed,
                                                                    a, cfg, history), log)
