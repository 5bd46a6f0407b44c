"""`kvmesh train-mtp`: train only the MTP module (model/mtp.py) on a frozen trunk.

Loss: cross-entropy of token i+2 from MTP(h_i, embed[t_{i+1}]), h_i the frozen trunk's last
residual stream (computed without gradient, bf16 autocast like `kvmesh train`). Depth 1
only: chained drafts (K > 1) reuse the same module at serving time (core/speculative.py).
The trunk's tensors are written out bit-identical to the base checkpoint's, plus `mtp.*`.

Run directory (as train/loop.py): state.pt (MTP weights, optimizer, step, data RNG, elapsed:
`--resume`), model.safetensors (trunk + mtp.*), train.log. Deterministic for a seed: the
MTP init comes from `init_weights(..., mtp=True)` and the batches from a generator seeded
`seed + 1` whose state is checkpointed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.engine.model import mtp, ops
from services.engine.model import weights as weights_mod
from training import data
from training.loop import (
    RunArgs,
    _atomic_save,
    make_optimizer,
    resume_from,
    run_steps,
    save_model,
    start_run,
)
from training.model import hidden_states
from training.mtp_chain import chained, depth1

RESUME_KEYS = ("base", "preset", "seed", "batch", "seq_len", "steps", "lr", "warmup", "chunk", "depth")


@dataclass
class MtpArgs(RunArgs):
    out: str = "runs/mtp"
    steps: int = 4000
    batch: int = 1
    warmup: int = 50
    log_every: int = 10
    eval_every: int = 200
    base: str = "models/v4-mini-tiny"     # a model directory or a .safetensors file
    minutes: float = 0.0              # time budget; 0 = none. The cosine follows it too
    depth: int = 1                    # 2: also train the chained row (the second draft)

    # the names run_steps and lr_at read: a budgeted MTP run always anneals by time
    @property
    def time_budget_min(self) -> float:
        return self.minutes

    @property
    def decay_by_time(self) -> bool:
        return bool(self.minutes)


def trunk_states(w, cfg, tokens, chunk: int, bf16: bool):
    """Frozen trunk: tokens [N, T] -> h [N, T, hidden] fp32, no gradient."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        h, _ = hidden_states(w, cfg, tokens, chunk=chunk)
    return h.float()


def mtp_logits(w, cfg, h, next_tokens, chunk: int, bf16: bool = False):
    """h [N, T, hidden] at positions 0..T-1, next_tokens [N, T] (t_{i+1}) -> [N, T, V] logits
    of t_{i+2}. T must be a multiple of `chunk` (the training layer's window tiling)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y, _ = depth1(w, cfg, h, next_tokens, chunk)
        return mtp.logits(w, cfg, y).float()


def mtp_loss(w, cfg, batch, chunk: int, bf16: bool, depth: int = 1):
    """batch [N, S + 1 + depth] -> mean over depths of the CE (nats/token) of token i+1+d at
    depth d, over S MTP positions (depth 2: the chained row, train/mtp_chain.py)."""
    s = batch.shape[1] - 1 - depth
    h = trunk_states(w, cfg, batch[:, : s + 1], chunk, bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y1, kv1 = depth1(w, cfg, h[:, :s], batch[:, 1 : s + 1], chunk)
        logits = [mtp.logits(w, cfg, y1).float()]
        if depth == 2:
            logits.append(chained(w, cfg, y1, kv1, batch[:, 2 : s + 2], chunk).float())
    losses = [F.cross_entropy(lg.reshape(-1, lg.shape[-1]), batch[:, 2 + d : s + 2 + d].reshape(-1))
              for d, lg in enumerate(logits)]
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate(w, cfg, windows, chunk: int) -> dict:
    """Held-out windows [n, S + 2], fp32, teacher forced: MTP loss, top-1 accuracy against the
    true token i+2, and agreement of its argmax with the trunk's greedy token at i+1 given the
    true prefix (a proxy of greedy acceptance at draft position 1); `chain_agreement`: the
    same for the chained row (position 2) fed the true token i+2."""
    s = windows.shape[1] - 2
    loss = correct = agree = chain = 0.0
    for row in windows:
        h = trunk_states(w, cfg, row[None, : s + 2], chunk, False)
        greedy = ops.logits(w, h[0], cfg).argmax(-1)                   # trunk's pick after i
        y1, kv1 = depth1(w, cfg, h[:, :s], row[None, 1 : s + 1], chunk)
        lg = mtp.logits(w, cfg, y1)[0]
        loss += float(F.cross_entropy(lg, row[2:], reduction="sum"))
        pick = lg.argmax(-1)
        correct += float((pick == row[2:]).sum())
        agree += float((pick == greedy[1 : s + 1]).sum())
        pick2 = chained(w, cfg, y1, kv1, row[None, 2 : s + 2], chunk)[0].argmax(-1)
        chain += float((pick2[: s - 1] == greedy[2 : s + 1]).sum())
    n = s * len(windows)
    return {"mtp_loss": loss / n, "mtp_top1": correct / n, "draft_agreement": agree / n,
            "chain_agreement": chain / (n - len(windows))}


def _save(run: Path, w, trunk_names, opt, step, gen, elapsed, a: MtpArgs, cfg, history):
    state = {"mtp": {k: w[k].detach().clone() for k in w if k.startswith(mtp.PREFIX)},
             "opt": opt.state_dict(), "step": step, "gen": gen.get_state(), "elapsed": elapsed,
             "args": asdict(a), "history": history}
    _atomic_save(state, run / "state.pt")
    save_model(run, w, cfg)


def train_mtp(a: MtpArgs) -> dict:
    cfg, run, log = start_run(a)
    base_path = Path(a.base) / "model.safetensors" if Path(a.base).is_dir() else Path(a.base)
    base = weights_mod.load(base_path, cfg)
    trunk = {k: t for k, t in base.items() if not k.startswith(mtp.PREFIX)}
    # a base that has an MTP module already is trained further from it (e.g. --depth 2)
    fresh = base if mtp.has_mtp(base) else weights_mod.init_weights(cfg, a.seed, mtp=True)
    if a.depth not in (1, 2):
        raise ValueError(f"depth must be 1 or 2, got {a.depth}")
    w = dict(trunk)
    for k in mtp.shapes(cfg):
        w[k] = fresh[k].clone().requires_grad_(True)
    params = [w[k] for k in mtp.shapes(cfg)]
    opt = make_optimizer({k: w[k] for k in mtp.shapes(cfg)}, a)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(a.seed + 1)
    st, resumed = resume_from(a, run, RESUME_KEYS, opt, gen, log)
    if st is not None:
        with torch.no_grad():
            for k, t in st["mtp"].items():
                w[k].copy_(t)
    corpus = data.load_corpus()
    log(f"corpus {corpus.describe()}")
    val = data.eval_windows(corpus.val, a.eval_windows, a.seq_len + 1)
    n_params = sum(p.numel() for p in params)
    log(f"MTP module on frozen {cfg.name} trunk ({a.base}): {n_params:,} trained parameters; "
        f"{json.dumps(asdict(a), sort_keys=True)}")

    def step_loss():
        loss = mtp_loss(w, cfg, data.sample_batch(corpus.train, a.batch, a.seq_len + a.depth, gen),
                        a.chunk, a.bf16, a.depth)
        return loss, lambda: (f"mtp loss {loss.item():.4f}", {"loss": round(loss.item(), 5)})

    def held_out():
        ev = evaluate(w, cfg, val, a.chunk)
        return " ".join(f"{k} {v:.4f}" for k, v in ev.items()), {k: round(v, 5) for k, v in ev.items()}

    return run_steps(a, opt, params, resumed, step_loss, held_out,
                     lambda step, elapsed, history: _save(run, w, trunk, opt, step, gen, elapsed, a,
                                                          cfg, history), log)


SLICE = (2, 512)      # (windows, MTP positions) of the shipped checkpoint's quick check


def slice_metrics(w, cfg, val_stream) -> dict:
    """`evaluate` on the fixed small held-out slice the shipped-checkpoint test re-measures."""
    n, s = SLICE
    return evaluate(w, cfg, data.eval_windows(val_stream, n, s + 1), chunk=64)
