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

    python scripts/ship_v41_model.py --add-mtp MTP_RUN models/deepseek-v41-tiny --command "..."

adds a `kvmesh train-mtp` run's MTP module to the shipped directory (refused unless the
run's trunk tensors are the shipped ones, so the card's trunk numbers still hold), measures
the module's held-out agreement with the trunk, writes mtp_training.json and
train_mtp.log, and re-renders the card.
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


def _mtp_parts(directory: Path):
    from tokenizers import Tokenizer

    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
    from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
    from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule

    cfg, w = load_v41_checkpoint(directory, torch.float32)
    model = V41Model(cfg, w, torch.float32)
    return model, V41MtpModule(model), Tokenizer.from_file(str(directory / "tokenizer.json"))


def mtp_slice(directory: Path, parts=None) -> dict:
    """The MTP module on SLICE of the held-out code (what the test checks in seconds);
    parts: `_mtp_parts(directory)` when the caller has them."""
    from kvmesh.training import data, v41_data
    from kvmesh.training.v41_mtp import measure as mtp_agreement

    model, module, tok = parts or _mtp_parts(directory)
    root, files = v41_data.sources()["code"]
    windows = data.eval_windows(v41_data.encode(tok, root, data.split(files)[1]), *SLICE)
    return {"windows": SLICE[0], "seq_len": SLICE[1], **mtp_agreement(module, model, windows)}


def mtp_measure(directory: Path, windows: int, seq_len: int) -> dict:
    """The MTP module's held-out agreement with the trunk's greedy token, its accuracy on the
    text, and its loss, per kind (training/v41_mtp.measure), plus the quick slice."""
    from kvmesh.training import data, v41_data
    from kvmesh.training.v41_mtp import measure as mtp_agreement

    parts = model, module, tok = _mtp_parts(directory)
    out: dict = {"windows": windows, "seq_len": seq_len,
                 "parameters": sum(t.numel() for k, t in model.weights.items()
                                   if k.startswith("kvmesh.mtp."))}
    for kind, (root, files) in v41_data.sources().items():
        stream = v41_data.encode(tok, root, data.split(files)[1], kind)
        n = min(windows, len(stream) // (seq_len + 1))
        out[kind] = {"windows": n, **mtp_agreement(module, model,
                                                    data.eval_windows(stream, n, seq_len))}
    out["slice"] = mtp_slice(directory, parts)
    return out


def mtp_text(m: dict, t: dict | None) -> str:
    """The card's section on the MTP module, when the directory has one."""
    x = m.get("mtp")
    if x is None or t is None:
        return ""
    a = t["args"]
    rows = "\n".join(f"| {kind} | {x[kind]['windows']} x {x['seq_len']} | **{x[kind]['agree']:.3f}** "
                     f"| {x[kind]['accuracy']:.3f} | {x[kind]['loss']:.3f} |"
                     for kind in ("code", "english", "chat"))
    stopped = ("" if t["step"] >= t["steps_planned"] else
               f" (of {t['steps_planned']} planned: stopped by the {a['time_budget_min']:g}-minute "
               "time budget)")
    return f"""
## MTP module (kvmesh's own, for `--speculative mtp:K`)

V4.1 as released drafts with DSpark layers, which kvmesh does not serve; this model carries
kvmesh's MTP module instead (`"kvmesh": {{"mtp_layers": 1}}`, tensors under `kvmesh.mtp.0.`,
{x['parameters'] / 1e6:.2f}M parameters): one window-only V4.1 layer with a routed MoE
that reads the trunk's last streams at position i and the embedding of token i+1 and
predicts token i+2 (docs/engine/speculative.md). It was trained with the trunk frozen
(`kvmesh train-mtp`, `training/v41_mtp.py`) towards the trunk's own distribution for that
token: {t['step']} steps{stopped} x {a['batch']} x {a['seq_len']} tokens =
{t['tokens']:,} tokens, {t['minutes']} minutes on one CPU thread, AdamW lr {a['lr']:g},
seed {a['seed']}, the same data mix as the trunk.

Held-out windows, fp32: how often the module's argmax equals the trunk's greedy token
(what a first draft's greedy acceptance is on this text), its accuracy on the text's own
token, and its cross-entropy to the trunk (nats/token).

| kind | held out | agrees with the trunk | text accuracy | loss to the trunk |
|---|---|---|---|---|
{rows}

```sh
{t['command']}
.venv/bin/python scripts/ship_v41_model.py --add-mtp MTP_RUN models/deepseek-v41-tiny --command "..."
```
"""


def card(m: dict, t: dict, cfg: dict, t_mtp: dict | None = None) -> str:
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
release's tensor names. No hash-routed layer: V4.1 routes every layer by score.
{"kvmesh's MTP module beside the trunk (below)." if m.get("mtp") else "No MTP module."}

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
{mtp_text(m, t_mtp)}"""


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
    """metrics.json and the card rendered from it, the training records and the config."""
    cfg = json.loads((dest / "config.json").read_text())
    mtp_record = dest / "mtp_training.json"
    t_mtp = json.loads(mtp_record.read_text()) if mtp_record.exists() else None
    (dest / "metrics.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    (dest / "README.md").write_text(card(m, t, cfg, t_mtp))


def add_mtp(run: Path, dest: Path, args) -> int:
    """A train-mtp run's module into the shipped directory, its trunk checked to be ours."""
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint

    _, shipped = load_v41_checkpoint(dest, torch.float32)
    cfg, got = load_v41_checkpoint(run, torch.float32)
    if not cfg.mtp_layers:
        raise SystemExit(f"{run}: no MTP module (its config's kvmesh.mtp_layers is 0)")
    differ = [k for k in shipped if not k.startswith("kvmesh.mtp.") and
              (k not in got or not torch.equal(got[k], shipped[k]))]
    if differ:
        raise SystemExit(f"{run}: its trunk differs from {dest}'s ({differ[0]}, ...): the card's "
                         "numbers would not hold")
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run / name, dest / name)
    shutil.copyfile(run / "train.log", dest / "train_mtp.log")
    t_mtp = training_record(run, args.command)
    (dest / "mtp_training.json").write_text(json.dumps(t_mtp, indent=1, sort_keys=True) + "\n")
    m = json.loads((dest / "metrics.json").read_text())
    m["mtp"] = mtp_measure(dest, args.mtp_windows, 1024)
    write_card(dest, m, json.loads((dest / "training.json").read_text()))
    print(f"added the MTP module to {dest}: agreement with the trunk " + ", ".join(
        f"{k} {m['mtp'][k]['agree']:.3f}" for k in ("code", "english", "chat")))
    return 0


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
    ap.add_argument("--add-mtp", action="store_true",
                    help="RUN is a kvmesh train-mtp run: add its module to DEST")
    ap.add_argument("--mtp-windows", type=int, default=16,
                    help="held-out windows of 1024 tokens per kind for the MTP module")
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
    if args.add_mtp:
        return add_mtp(run, dest, args)
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
