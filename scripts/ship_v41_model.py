"""Ship a `kvmesh train` run as a Hugging Face checkpoint directory under models/.

    python scripts/ship_v41_model.py RUN_DIR models/deepseek-v41-tiny --command "kvmesh train ..."

Copies the run's config.json, model.safetensors and tokenizer files, measures the copy
(`kvmesh train-eval DIR`, unless --metrics names a metrics JSON already measured on the same
weights), writes training.json (steps, tokens, minutes, the loss history from
RUN_DIR/state.pt) and train.log, and renders the model card (README.md) from those numbers,
so the card never carries a number that was not measured.

    python scripts/ship_v41_model.py --remeasure models/deepseek-v41-tiny [--metrics M]

measures a shipped directory again (more windows, say) and re-renders its card, keeping its
weights and training record.
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

from kvmesh.training import v41_evaluate  # noqa: E402


def training_record(run: Path, command: str) -> dict:
    """What the run's state.pt says about its training: steps, tokens, time, arguments and
    the loss history, with the command that ran it and the versions it ran on."""
    st = torch.load(run / "state.pt", weights_only=False)
    a = st["args"]
    return {"command": command, "step": st["step"], "steps_planned": a["steps"],
            "tokens": st["step"] * a["batch"] * a["seq_len"], "minutes": round(st["elapsed"] / 60, 1),
            "seconds": round(st["elapsed"], 1),
            "args": a, "python": platform.python_version(), "torch": torch.__version__,
            "history": st["history"]}


FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "train.log")
SLICE = (2, 512)    # (windows, seq_len) of held-out code the shipped-model test re-measures


def slice_loss(directory: Path) -> float:
    """Mean nats/token over SLICE of the held-out code (what the test checks in seconds)."""
    from tokenizers import Tokenizer

    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
    from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
    from kvmesh.training import data, v41_data

    cfg, w = load_v41_checkpoint(directory, torch.float32)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    root, files = v41_data.sources()["code"]
    _, val_files = data.split(files)
    windows = data.eval_windows(v41_data.encode(tok, root, val_files), *SLICE)
    return float(v41_evaluate.position_losses(V41Model(cfg, w, torch.float32), windows).mean())


def card(m: dict, t: dict, cfg: dict) -> str:
    a = t["args"]
    text = cfg["text_config"]
    stopped = ("" if t["step"] >= t["steps_planned"] else
               f" (of {t['steps_planned']} planned: stopped by the {a['time_budget_min']:g}-minute "
               "time budget, the cosine following elapsed time)")
    rows = []
    for kind in ("code", "english", "chat"):
        k, bw = m[kind], m[kind]["beyond_window"]
        rows.append(f"| {kind} | {k['held_out_files']} files, {k['windows']} x {m['eval_seq_len']} "
                    f"tokens | **{k['bits_per_byte']:.3f}** | {k['token_unigram_bits_per_byte']:.3f} | "
                    f"{k['byte_unigram_bits_per_byte']:.3f} | {k['bytes_per_token']:.2f} | "
                    f"{bw['gap_bits_per_byte']:+.4f} ± {bw['gap_stderr_bits_per_byte']:.4f} "
                    f"(n = {bw['n']:,}) |")
    table = "\n".join(rows)
    ratios = text["compress_ratios"]
    return f"""---
license: mit
library_name: kvmesh
pipeline_tag: text-generation
---

# deepseek-v41-tiny: kvmesh's default model

A {m['parameters'] / 1e6:.1f}M-parameter model in DeepSeek V4.1's architecture
(`model_type: deepseek_v41`), trained from scratch on one CPU thread, so that what a newcomer
runs, and what kvmesh's cache benchmarks measure, is the architecture users deploy. It writes
Python-shaped code and English-shaped prose and answers "what does X do?" in the chat format;
it knows little.

## Architecture

{text['num_hidden_layers']} layers, hidden {text['hidden_size']}, {text['num_attention_heads']}
heads of {text['head_dim']} (RoPE on {text['qk_rope_head_dim']}), sliding window
{text['sliding_window']}, vocabulary {text['vocab_size']} (byte-level BPE with DeepSeek's
special tokens at ids 0-5), hyper-connections with hc_mult {text['hc_mult']}, MoE with
{text['n_routed_experts']} routed experts ({text['num_experts_per_tok']} per token, every layer
routed by sqrtsoftplus score + `gate.bias`) and a shared expert. `compress_ratios`
{ratios}: KV sources {text['kv_source_layer_ids']} (layer 1 owns an m = 128 cache whose few
entries index_topk {text['index_topk']} covers, HCA's dense read; layer 2 an m = 4 cache, the
candidate source, keeping {text['candidate_topk_blocks']} blocks of
{text['candidate_block_size']} entries), index sources {text['index_source_layer_ids']},
decoder (consumer) layers 2-{text['num_hidden_layers'] - 1}. bf16 safetensors in the
release's tensor names. No MTP layer and no hash-routed layer: V4.1 routes every layer by
score.

## Data

Three kinds, each split by the SHA-256 of the file's relative path (the lowest 3 % held out,
never seen by the tokenizer or the model; `training/v41_data.py`):

- code: the Python {t['python']} standard library's .py files ({m['code']['train_files']}
  train, {m['code']['train_tokens']:,} tokens);
- English: the prose installed packages ship (METADATA and .md / .rst files in site-packages,
  {m['english']['train_files']} train files, {m['english']['train_tokens']:,} tokens; which
  packages depends on the environment `make install` builds);
- chat: one conversation per documented public function, class or method of the code files
  ({m['chat']['train_tokens']:,} tokens), the docstring's first paragraph as the answer.

Training rows: {1 - a['english_fraction'] - a['chat_fraction']:.0%} code, {a['english_fraction']:.0%}
English, {a['chat_fraction']:.0%} chat, random windows of {a['seq_len']} tokens.

## Training

- {t['step']} steps{stopped} x {a['batch']} x {a['seq_len']} tokens = **{t['tokens']:,} tokens**,
  **{t['minutes']} minutes** on one CPU thread of a shared 2-core machine
  ({t['tokens'] / max(t['seconds'], 1e-9):,.0f} tokens/s; torch {t['torch']}).
- AdamW (0.9, 0.95), lr {a['lr']:g}, {a['warmup']} warm-up steps, cosine to
  {a['min_lr_frac']:g} x lr, weight decay {a['weight_decay']:g} on matrices, clip
  {a['clip']:g}, fp32, seed {a['seed']}. The forward is V4.1's full-sequence forward
  (`v41_forward.py`); each index source learns from KL(its layer's attention over the
  visible entries || its index scores), weight {a['kl_weight']:g}, inputs detached; gate
  biases step {a['balance_rate']:g} towards equal loads after each step.

Reproduce:

```sh
.venv/bin/kvmesh train-tokenizer --out RUN_DIR --vocab-size {text['vocab_size']}
{t['command']}
.venv/bin/python scripts/ship_v41_model.py RUN_DIR models/deepseek-v41-tiny --command "..."
```

## Measured (`kvmesh train-eval models/deepseek-v41-tiny --windows {m['code']['windows']} --cut-stride {m['code']['beyond_window']['positions'].rsplit(' ', 1)[-1]}`)

Held-out files, fp32, non-overlapping windows; bits per UTF-8 byte (a special token counts
one byte). Gap: bits/byte lost at positions {m['code']['beyond_window']['positions']} when the
context is cut to the last {text['sliding_window']} tokens, ± its standard error; positive
means the compressed caches carry information from beyond the window. The window holds
about {text['sliding_window'] * m['code']['bytes_per_token']:.0f} bytes of code here (a
byte-level model's holds 128), so there is less past it to gain than for V4-mini.

| kind | held out | this model | token unigram | byte unigram | bytes/token | gap beyond the window |
|---|---|---|---|---|---|---|
{table}

{copy_text(m, text['sliding_window'])}
Quick check (`tests/engine/model/test_shipped_v41_model.py`): {m['slice']['windows']} held-out code
windows of {m['slice']['seq_len']} tokens, {m['slice']['loss_nats']:.4f} nats/token.
"""


def copy_text(m: dict, window: int) -> str:
    """The card's paragraph on the copy test (v41_evaluate.copy_losses), when measured."""
    c = m["code"].get("copy")
    if c is None:
        return ""
    first, repeat = c["first_copy_nats_per_token"], c["repeat_nats_per_token"]
    full, cut = c["repeat_full_context_nats_per_token"], c["repeat_cut_to_window_nats_per_token"]
    verdict = ("it copies: the repeat costs well under the first copy" if repeat < 0.5 * first
               else "it does not copy: the repeat costs about what the first copy did")
    return "\n".join([
        f"Copying past the window ({c['rows']} held-out code snippets of {c['snippet_tokens']} "
        "tokens, each followed",
        "by a separator and the same snippet again): nats per token on the first copy "
        f"{first:.3f}, on the",
        f"repeat {repeat:.3f}; at the {c['repeat_sampled_positions']} sampled repeat positions "
        "whose first occurrence is",
        f"out of the window, {full:.3f} with the whole context and {cut:.3f} with the last "
        f"{window} tokens only: {verdict}.", ""])


def measure(dest: Path, args) -> dict:
    if args.metrics:
        m = json.loads(Path(args.metrics).read_text())
    else:
        m = v41_evaluate.evaluate(str(dest), windows=args.windows, cut_stride=args.cut_stride)
    m["checkpoint"] = str(dest)
    m["slice"] = {"windows": SLICE[0], "seq_len": SLICE[1], "loss_nats": slice_loss(dest)}
    return m


def write_card(dest: Path, m: dict, t: dict) -> None:
    """metrics.json and the card rendered from it, the training record and the config."""
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "metrics.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    (dest / "README.md").write_text(card(m, t, cfg))


def remeasure(dest: Path, args) -> int:
    """A shipped directory measured again; its weights and training.json stay as they are."""
    old = json.loads((dest / "metrics.json").read_text())
    m = {**measure(dest, args), "parameters": old["parameters"]}
    write_card(dest, m, json.loads((dest / "training.json").read_text()))
    print(f"remeasured {dest}: gap beyond the window "
          f"{m['code']['beyond_window']['gap_bits_per_byte']:+.4f} ± "
          f"{m['code']['beyond_window']['gap_stderr_bits_per_byte']:.4f} bits/byte (code)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="the train run directory")
    ap.add_argument("dest")
    ap.add_argument("--command", help="the exact training command (required to ship a run)")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure the shipped DEST again and re-render its card (no RUN)")
    ap.add_argument("--metrics", help="metrics JSON already measured on these weights")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--cut-stride", type=int, default=16)
    args = ap.parse_args(argv)
    if args.remeasure:
        if args.run:
            ap.error("--remeasure takes DEST only")
        return remeasure(Path(args.dest), args)
    if not args.run or not args.command:
        ap.error("shipping a run needs RUN, DEST and --command")
    run, dest = Path(args.run), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(run / name, dest / name)
    m = measure(dest, args)
    st = torch.load(run / "state.pt", weights_only=False)
    m["parameters"] = sum(t.numel() for t in st["weights"].values())
    t = training_record(run, args.command)
    (dest / "training.json").write_text(json.dumps(t, indent=1, sort_keys=True) + "\n")
    write_card(dest, m, t)
    print(f"shipped {dest}: code {m['code']['bits_per_byte']:.3f}, English "
          f"{m['english']['bits_per_byte']:.3f} bits/byte held-out; gap beyond the window "
          f"{m['code']['beyond_window']['gap_bits_per_byte']:+.4f} bits/byte (code)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
