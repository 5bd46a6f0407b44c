"""The step loop a training run shares (`kvmesh train`, v41_loop.py): AdamW, warm-up +
cosine, gradient clipping, progress lines with tokens/s and ETA, held-out evaluations,
atomic checkpoints, a time budget, and resuming a run where it stopped.

One process owns everything here. The run directory holds:
    state.pt            weights + optimizer + step + data RNG + elapsed time (resume)
    model.safetensors   the weights as the engine loads them
    train.log           the progress lines (also printed)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class StepArgs:
    """The step loop's settings (a training command subclasses it with its own defaults
    and the fields its model and data need)."""
    out: str = "runs/train"
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
    time_budget_min: float = 0.0      # 0 = no limit; otherwise stop and save when reached
    decay_by_time: bool = False       # cosine progress = max(step, elapsed time) fraction


def lr_at(step: int, a: StepArgs, elapsed: float = 0.0) -> float:
    """Linear warm-up, then cosine to min_lr_frac * lr. With `decay_by_time` and a time
    budget the cosine follows whichever is further along, the steps or the budget, so a
    run stopped by its budget on a slow (shared) machine still ends annealed."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    if a.decay_by_time and a.time_budget_min:
        frac = max(frac, min(1.0, elapsed / (a.time_budget_min * 60)))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(w, a: StepArgs):
    decay = [t for k, t in w.items() if t.dim() == 2]
    rest = [t for k, t in w.items() if t.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=a.lr, betas=(0.9, 0.95), eps=1e-8)


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Log:
    """Progress lines to stdout and run/train.log (owned by the loop)."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.f.write(line + "\n")


def save_state(run: Path, weights: dict, opt, gen, step: int, elapsed: float, args: dict,
               history: list) -> None:
    """run/state.pt: what `resume_from` and `restore` read back (the weights trained, the
    optimizer, the step, the data and torch RNG states, the time spent, the run's args)."""
    atomic_save({"weights": {k: t.detach().clone() for k, t in weights.items()},
                 "opt": opt.state_dict(), "step": step, "gen": gen.get_state(),
                 "torch_rng": torch.get_rng_state(), "elapsed": elapsed, "args": args,
                 "history": history}, run / "state.pt")


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


def run_steps(a: StepArgs, opt, params, resumed: tuple, step_loss, evaluate, save, log) -> dict:
    """The step loop: the learning rate of `lr_at`, backward with the
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
