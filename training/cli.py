"""`kvmesh train` (the shipped DeepSeek V4.1 model on code and English), `kvmesh train-mtp`
(its MTP drafter, the trunk frozen), `kvmesh train-tokenizer` (its BPE tokenizer) and
`kvmesh train-eval` (measure a checkpoint)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields

HELP = {
    "out": "run directory: checkpoints, model.safetensors, train.log",
    "steps": "optimizer steps",
    "batch": "sequences per step",
    "seq_len": "tokens (bytes) per training sequence",
    "lr": "peak learning rate (AdamW)",
    "min_lr_frac": "cosine decay ends at this fraction of --lr",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient norm clip",
    "kl_weight": "weight of the lightning indexer's KL loss",
    "seed": "seed for weights, data order and sampling",
    "threads": "torch threads",
    "log_every": "steps between progress lines",
    "eval_every": "steps between held-out evaluations",
    "eval_windows": "held-out windows per evaluation",
    "ckpt_minutes": "minutes between resumable checkpoints",
    "time_budget_min": "stop and save after this many minutes; 0 = no limit",
    "decay_by_time": "with --time-budget-min: anneal the lr by elapsed time as well as by step",
    "resume": "continue from the run directory's checkpoint",
}


V41_HELP = {
    **HELP,
    "out": "run directory: a Hugging Face checkpoint (config.json, model.safetensors, the "
           "tokenizer files) plus state.pt, tokens.pt and train.log",
    "tokenizer": "directory holding tokenizer.json (kvmesh train-tokenizer); required",
    "init_from": "start from this checkpoint directory's weights (a second phase: its own "
                 "schedule, a fresh optimizer); empty: fresh weights from --seed",
    "seq_len": "tokens per training sequence",
    "kl_weight": "weight of the index sources' KL loss",
    "balance_rate": "step of the gate.bias update towards equal expert loads",
    "english_fraction": "share of the training sequences drawn from the English text",
    "chat_fraction": "share of the training sequences drawn from the conversations",
    "copy_fraction": "share of the training sequences that repeat a code snippet longer than "
                     "the window (teaches retrieval from the compressed caches)",
}


MTP_HELP = {
    **HELP,
    "out": "run directory: the trunk's checkpoint with the MTP module added (config.json, "
           "model.safetensors, the tokenizer files) plus state.pt, tokens.pt and train.log",
    "trunk": "the trained DeepSeek V4.1 checkpoint directory the module drafts for (its "
             "weights stay frozen); required",
    "seq_len": "tokens per training sequence",
    "english_fraction": V41_HELP["english_fraction"],
    "chat_fraction": V41_HELP["chat_fraction"],
}


def _add_fields(p, cls, helps) -> None:
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        text = helps[f.name] + " (default: %(default)s)"
        if f.type in ("bool", bool):
            if f.default:
                p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                               action="store_false", help=f"turn off: {text}")
            else:
                p.add_argument(flag, action="store_true", default=f.default, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, type=kind, default=f.default, help=text)


def register(sub) -> None:
    from kvmesh.training.v41_loop import V41TrainArgs

    v = sub.add_parser("train", help="train the shipped DeepSeek V4.1 model on code and "
                       "English (CPU)")
    _add_fields(v, V41TrainArgs, V41_HELP)
    v.set_defaults(func=_train_v41)

    from kvmesh.training.v41_mtp import MtpTrainArgs

    m = sub.add_parser("train-mtp", help="train kvmesh's MTP module (the drafter of "
                       "--speculative mtp:K) on a trained DeepSeek V4.1 checkpoint (CPU)")
    _add_fields(m, MtpTrainArgs, MTP_HELP)
    m.set_defaults(func=_train_mtp)

    e = sub.add_parser("train-eval", help="held-out bits/byte, unigram baseline, context beyond the window")
    e.add_argument("checkpoint", help="a DeepSeek V4.1 checkpoint directory (code and English "
                   "measured apart)")
    e.add_argument("--windows", type=int, default=32,
                   help="held-out windows of --seq-len tokens (default: %(default)s)")
    e.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per window (default: %(default)s)")
    e.add_argument("--cut-stride", type=int, default=32,
                   help="every Nth position >= 512 for the cut test (default: %(default)s)")
    e.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    e.add_argument("--out", default=None,
                   help="write the metrics JSON here (default: print only)")
    e.set_defaults(func=_eval)

    t = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (DeepSeek's "
                       "special tokens first) on the training split of the code and English corpus")
    t.add_argument("--out", required=True, help="directory for tokenizer.json and "
                   "tokenizer_config.json; required, no default")
    t.add_argument("--vocab-size", type=int, default=8192, help="ids in all, the 6 special "
                   "tokens and the 256 bytes included")
    t.add_argument("--min-frequency", type=int, default=2, help="a pair merges once it is seen "
                   "this often")
    t.set_defaults(func=_train_tokenizer)


def _train_tokenizer(args) -> int:
    from pathlib import Path

    from kvmesh.training import bpe, v41_data
    try:
        tok = bpe.train(v41_data.training_texts(), args.vocab_size, args.min_frequency)
    except ValueError as exc:
        print(f"kvmesh train-tokenizer: {exc}", file=sys.stderr)
        return 2
    bpe.save(tok, Path(args.out))
    print(f"wrote {args.out}/tokenizer.json ({tok.get_vocab_size()} ids) and "
          "tokenizer_config.json")
    return 0


def _train_v41(args) -> int:
    from kvmesh.training.v41_loop import V41TrainArgs, train_v41

    return _run("kvmesh train", V41TrainArgs, train_v41, args)


def _train_mtp(args) -> int:
    from kvmesh.training.v41_mtp import MtpTrainArgs, train_mtp

    return _run("kvmesh train-mtp", MtpTrainArgs, train_mtp, args)


def _run(command: str, args_cls, fn, args) -> int:
    """Parsed flags -> the run's args dataclass -> fn; a bad setting is exit 2, not a trace."""
    try:
        result = fn(args_cls(**{f.name: getattr(args, f.name) for f in fields(args_cls)}))
    except ValueError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _eval(args) -> int:
    from kvmesh.checkpoint_dir import model_type
    from kvmesh.training import v41_evaluate

    try:
        if model_type(args.checkpoint) != "deepseek_v41":
            raise ValueError(f"{args.checkpoint}: not a DeepSeek V4.1 checkpoint directory")
        metrics = v41_evaluate.evaluate(args.checkpoint, args.windows, args.seq_len,
                                        args.cut_stride, args.threads)
    except ValueError as exc:   # CheckpointError is one
        print(f"kvmesh train-eval: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(metrics, indent=2, sort_keys=True)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0
