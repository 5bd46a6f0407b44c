"""`kvmesh train-mtp`: train kvmesh's MTP module (model/deepseek_v4/v41_mtp.py) on a trained
DeepSeek V4.1 checkpoint whose own weights stay frozen, with the shared step loop
(steps.run_steps: AdamW, warm-up + cosine, progress with an ETA, held-out evaluations, a time
budget, resumable checkpoints).

What it learns: row p of the module (the trunk's last streams at p, token p + 1) is trained
towards the trunk's own distribution for token p + 2, which the trunk computes at row p + 1
(a soft-target cross-entropy, i.e. distillation), not towards the text's token: a draft is
accepted when it is what the trunk would emit, so that is the target. Held-out evaluations
report both the text accuracy and the agreement with the trunk's greedy token (the first
draft's greedy acceptance rate when the text is what was generated).

The run directory becomes the trunk's checkpoint directory plus the module: config.json with
`"kvmesh": {"mtp_layers": 1}`, model.safetensors with the trunk's tensors as they were and the
module's under `kvmesh.mtp.0.`, the tokenizer files, state.pt (resume) and train.log.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config, read_v41_config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule, block_config
from kvmesh.services.engine.model.deepseek_v4.v41_names import MTP, mtp_shapes
from kvmesh.training import data, v41_data
from kvmesh.training.steps import (
    Log,
    make_optimizer,
    restore,
    resume_from,
    run_steps,
    save_state,
)
from kvmesh.training.v41_loop import V41StepArgs, save_hf
from kvmesh.training.v41_model import initial_weights

RESUME_KEYS = ("seed", "batch", "seq_len", "steps", "lr", "warmup", "decay_by_time",
               "english_fraction", "chat_fraction", "trunk")


@dataclass
class MtpTrainArgs(V41StepArgs):
    out: str = "runs/v41-mtp"
    trunk: str = ""
    steps: int = 2000


def initial_mtp_weights(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """float32 weights of the module under `kvmesh.mtp.0.`: its layer drawn as a fresh
    one-layer model's (`initial_weights`), the input projections N(0, 1 / D), norms at 1,
    and the head collapse's base at 0 (each stream weighs about half)."""
    g = torch.Generator().manual_seed(seed)
    D, n = cfg.hidden_size, cfg.hc_mult
    layer = {MTP + k[len("layers.0."):]: v
             for k, v in initial_weights(block_config(cfg), seed).items()
             if k.startswith("layers.0.")}
    own = {"e_proj.weight": torch.randn(D, D, generator=g) / math.sqrt(D),
           "h_proj.weight": torch.randn(D, D, generator=g) / math.sqrt(D),
           "enorm.weight": torch.ones(D), "hnorm.weight": torch.ones(D),
           "norm.weight": torch.ones(D),
           "hc_head_fn": torch.randn(n, n * D, generator=g) * (0.1 / math.sqrt(n * D)),
           "hc_head_base": torch.zeros(n), "hc_head_scale": torch.ones(1)}
    w = {**layer, **{MTP + k: v for k, v in own.items()}}
    expected = mtp_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in w.items()} == expected, "MTP shapes drift"
    return w


def mtp_targets(trunk: V41Model, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row of S + 1 tokens -> the trunk's last streams of positions [0, S - 1) and its
    log-probabilities for the token after each one's next ([S - 1, vocab]: the trunk's rows
    1..S-1)."""
    streams, pre = trunk.final_streams(row[:-1])
    with torch.no_grad():
        logp = trunk.head(streams, pre).float().log_softmax(dim=-1)
    return streams[:-1], logp[1:]


def mtp_loss(module: V41MtpModule, trunk: V41Model, row: torch.Tensor):
    """-> (soft-target cross-entropy to the trunk's next-next distribution, the module's
    logits [S - 1, vocab], the trunk's log-probabilities)."""
    streams, logp = mtp_targets(trunk, row)
    n = streams.shape[0]
    y, _ = module.rows(torch.arange(n), row[1:n + 1], streams)
    logits = module.logits(y).float()
    loss = -(logp.exp() * logits.log_softmax(dim=-1)).sum(dim=-1).mean()
    return loss, logits, logp


@torch.no_grad()
def measure(module: V41MtpModule, trunk: V41Model, windows: torch.Tensor) -> dict[str, float]:
    """Held-out windows [N, S + 1] -> the module's agreement with the trunk's greedy token,
    its accuracy on the text's token p + 2, and its loss (nats/token, to the trunk)."""
    agree = right = total = 0
    loss = 0.0
    for row in windows:
        row = row.long()
        part, logits, logp = mtp_loss(module, trunk, row)
        draft = logits.argmax(dim=-1)
        agree += int((draft == logp.argmax(dim=-1)).sum())
        right += int((draft == row[2:2 + len(draft)]).sum())
        total += len(draft)
        loss += float(part) * len(draft)
    return {"agree": agree / total, "accuracy": right / total, "loss": loss / total}


def train_mtp(a: MtpTrainArgs) -> dict:
    from tokenizers import Tokenizer

    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint

    trunk_dir = Path(a.trunk)
    if not a.trunk or not (trunk_dir / "config.json").is_file():
        raise ValueError(f"--trunk {a.trunk!r}: expected a DeepSeek V4.1 checkpoint directory "
                         "(config.json, model.safetensors, tokenizer.json)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    run = Path(a.out)
    run.mkdir(parents=True, exist_ok=True)
    log = Log(run / "train.log")
    raw = json.loads((trunk_dir / "config.json").read_text())
    raw.setdefault("text_config", {}).setdefault("kvmesh", {})["mtp_layers"] = 1
    raw.pop("torch_dtype", None)
    cfg = read_v41_config(trunk_dir)
    if cfg.mtp_layers:
        raise ValueError(f"--trunk {a.trunk}: it already has an MTP module (its config's "
                         "kvmesh.mtp_layers)")
    _, trunk_w = load_v41_checkpoint(trunk_dir, torch.float32)
    trunk = V41Model(cfg, trunk_w, torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (trunk_dir / name).resolve() != (run / name).resolve():
            shutil.copy(trunk_dir / name, run / name)
    tok = Tokenizer.from_file(str(trunk_dir / "tokenizer.json"))
    corpus = v41_data.load(tok, run / "tokens.pt")
    log(f"corpus {corpus.describe()}")
    val = {kind: data.eval_windows(corpus.val[kind], a.eval_windows, a.seq_len)
           for kind in v41_data.KINDS}

    w = {k: t.requires_grad_(True) for k, t in initial_mtp_weights(cfg, a.seed).items()}
    # the MoE's gate.bias stays 0: with one layer and a short run there is no balancing step
    trained = {k: t for k, t in w.items() if not k.endswith("gate.bias")}
    opt = make_optimizer(trained, a)
    gen = torch.Generator().manual_seed(a.seed + 1)
    st, resumed = resume_from(a, run, RESUME_KEYS, opt, gen, log)
    if st is not None:
        restore(st, w)
    module = V41MtpModule(V41Model(cfg, {**trunk_w, **w}, torch.float32))
    log(f"MTP module on {a.trunk}: {sum(t.numel() for t in w.values()):,} parameters "
        f"(trunk frozen); {json.dumps(asdict(a), sort_keys=True)}")

    def one_step():
        rows = v41_data.sample(corpus, a.batch, a.seq_len, a.english_fraction, a.chat_fraction,
                               gen, 0.0, None)
        losses = [mtp_loss(module, trunk, row.long())[0] for row in rows]
        loss = torch.stack(losses).mean()
        value = float(loss.detach())
        return loss, lambda: (f"loss {value:.4f} nats/token (to the trunk)",
                              {"loss": round(value, 5)})

    def evaluate():
        got = {kind: measure(module, trunk, val[kind]) for kind in v41_data.KINDS}
        return (" ".join(f"{k} agree {v['agree']:.3f} acc {v['accuracy']:.3f}"
                         for k, v in got.items()),
                {f"val_{k}_{m}": round(x, 4) for k, v in got.items() for m, x in v.items()})

    def save(step, elapsed, history):
        save_state(run, w, opt, gen, step, elapsed, asdict(a), history)
        save_hf(run, raw, {**trunk_w, **w})

    return run_steps(a, opt, list(trained.values()), resumed, one_step, evaluate, save, log)
