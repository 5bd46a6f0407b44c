"""Ship a training run as models/<name>/: weights, measured metrics, training record, model card.

    python scripts/ship_model.py RUN_DIR models/v4-mini-tiny --command "kvmesh train ..."

Copies RUN_DIR/model.safetensors, measures it (`kvmesh train-eval`, unless --metrics names
an existing metrics JSON of that same file), writes training.json (steps, tokens, minutes
and the loss history from RUN_DIR/state.pt) and renders MODEL_CARD.md from those numbers,
so the card never carries a number that was not measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.evaluate import evaluate  # noqa: E402


def training_record(run: Path, command: str) -> dict:
    st = torch.load(run / "state.pt", weights_only=False)
    a = st["args"]
    return {"command": command, "step": st["step"], "steps_planned": a["steps"],
            "tokens": st["step"] * a["batch"] * a["seq_len"], "minutes": round(st["elapsed"] / 60, 1),
            "seconds": round(st["elapsed"], 1),
            "args": a, "python": platform.python_version(), "torch": torch.__version__,
            "history": st["history"]}


def card(m: dict, t: dict) -> str:
    bw = m["beyond_window"]
    a = t["args"]
    by_time = a.get("decay_by_time") and a["time_budget_min"]
    stopped = ("" if t["step"] >= t["steps_planned"] else
               f" (of {t['steps_planned']} planned: stopped by the {a['time_budget_min']:g}-minute "
               "time budget" + (")" if by_time else
                                ", so the learning rate had not finished its cosine decay)"))
    decay = (f"over the {a['time_budget_min']:g}-minute time budget (`--decay-by-time`: the cosine "
             "follows elapsed time or steps, whichever is further along, so the run ends annealed)"
             if by_time else f"over {t['steps_planned']} steps")
    return f"""# V4-mini `tiny`, trained on the Python standard library

The default weights of kvmesh's `tiny` preset (`services/engine/config.py`): 8 layers (YOCO
encoder [swa, swa, csa, hca] + decoder [csa, hca, csa, hca]), hidden 128, 2 query heads over a
shared 512-d latent (RoPE on 64 dims), W = 128, CSA m = 4 with a top-16 lightning indexer
(2 x 32), HCA m = 128, byte-level vocabulary (260). fp32 safetensors,
config in the file's metadata (`kvmesh_config`); the engine refuses it under another config.

## Data

Every `.py` file of the Python {t['python']} standard library (`sysconfig` stdlib dir,
site-packages excluded), sorted by path: {m['train_files']} training files
({m['train_tokens']:,} bytes + one EOS per file) and {m['held_out_files']} held-out files,
chosen by the SHA-256 of the relative path (< 3 %), never trained on
(`training/data.py`). Samples are random {a['seq_len']}-byte windows of the
concatenated training files.

## Training

- {t['step']} steps{stopped} x {a['batch']} x {a['seq_len']} tokens = **{t['tokens']:,} tokens seen**
  (about {t['tokens'] / m['train_tokens']:.3f} epochs), **{t['minutes']} minutes** on one CPU
  thread of a shared 2-core machine ({t['tokens'] / (60 * t['minutes']):,.0f} tokens/s; torch {t['torch']}).
- AdamW (0.9, 0.95), lr {a['lr']:g}, {a['warmup']} warmup steps then cosine to
  {a['min_lr_frac']:g} x lr {decay},
  weight decay {a['weight_decay']:g} on matrices, gradient clip {a['clip']:g}, bf16 autocast
  (fp32 master weights), seed {a['seed']}.
- Same forward as the engine's reference (`services/engine/model/reference.py`) without
  MXFP8 (serving quantizes the SWA KV); CSA uses the indexer's hard top-k; the indexer is
  trained only by KL(main attention over the visible compressed entries || indexer
  softmax), weight {a['kl_weight']:g}. No MTP module.

Reproduce (then `python scripts/ship_model.py RUN_DIR models/v4-mini-tiny --command ...`):

```sh
{t['command']}
```

The run is deterministic for a seed and resumable (`--resume` continues from
`RUN_DIR/state.pt`); with a time budget the step it stops at (and, with `--decay-by-time`,
the learning rate of each step) depends on the machine's speed.

## Measured (held-out files, `kvmesh train-eval`)

{m['eval_windows']} evenly spaced held-out windows of {m['eval_seq_len']} bytes ({m['eval_tokens']:,} predictions), fp32:

| | bits/byte |
|---|---|
| this model, SWA KV unquantized | **{m['val_bits_per_byte']:.3f}** |
| this model, MXFP8 SWA KV (as served) | {m['val_bits_per_byte_mxfp8']:.3f} |
| byte-unigram baseline (add-one, training counts) | {m['unigram_bits_per_byte']:.3f} |

Context beyond the 128-token window, positions {bw['positions']} ({bw['n']} predictions):
full context {bw['full_context_nats']:.4f} nats/byte, context cut to the last 128 tokens
{bw['cut_to_128_nats']:.4f} nats/byte: **gap {bw['gap_nats']:.4f} nats/byte** (standard
error {bw['gap_stderr_nats']:.4f}; the target was >= 0.05).

Quick check (`tests/engine/model/test_shipped_model.py`): {m['slice']['windows']} held-out windows of
{m['slice']['seq_len']} bytes, {m['slice']['loss_nats']:.4f} nats/byte.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("dest")
    ap.add_argument("--command", required=True, help="the exact training command")
    ap.add_argument("--metrics", help="metrics JSON already measured for this checkpoint")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--cut-stride", type=int, default=32)
    args = ap.parse_args(argv)
    run, dest = Path(args.run), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "model.safetensors", dest / "model.safetensors")
    if args.metrics:
        m = json.loads(Path(args.metrics).read_text())
    else:
        m = evaluate(str(dest / "model.safetensors"), windows=args.windows,
                     cut_stride=args.cut_stride)
    m["checkpoint"] = str(dest / "model.safetensors")
    t = training_record(run, args.command)
    (dest / "metrics.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    (dest / "training.json").write_text(json.dumps(t, indent=1, sort_keys=True) + "\n")
    (dest / "MODEL_CARD.md").write_text(card(m, t))
    print(f"shipped {dest}: {m['val_bits_per_byte']:.3f} bits/byte held-out, "
          f"gap beyond the window {m['beyond_window']['gap_nats']:.4f} nats/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
