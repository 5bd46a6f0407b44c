"""`kvmesh score`: a checkpoint's full forward over ids or text, as JSON."""

from __future__ import annotations

import json
import sys

from services.engine.model.deepseek_v4.checkpoint import DTYPES
from services.engine.model.deepseek_v4.errors import CheckpointError


def register(sub) -> None:
    p = sub.add_parser(
        "score", help="score token ids or text with a DeepSeek V4 or V4.1 checkpoint (full forward)",
        description="Run the full-sequence forward of a DeepSeek V4 or V4.1 checkpoint directory "
        "(chosen by config.json's model_type) and "
        'print {"ids", "logprobs", "argmax"} as JSON on stdout (logprobs[i]: log-probability '
        "of ids[i] after ids[:i]; argmax[i]: the likeliest id after ids[:i+1]) and the "
        "perplexity on stderr.")
    p.add_argument("text", nargs="?", help="text to score through the checkpoint's tokenizer.json "
                   "(begin-of-sentence id first)")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, "
                   "model.safetensors or shards); required, no default")
    p.add_argument("--ids", help="comma-separated token ids to score instead of text "
                   "(default: none, TEXT is scored)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the dtype the forward computes in")
    p.set_defaults(func=_score)


def _score(args) -> int:
    from services.engine.model.deepseek_v4 import score as scoring

    if (args.ids is None) == (args.text is None):
        print("kvmesh score: give either TEXT or --ids", file=sys.stderr)
        return 2
    try:
        ids = [int(t) for t in args.ids.split(",")] if args.ids is not None else None
    except ValueError:
        print(f"kvmesh score: --ids must be comma-separated integers, got {args.ids!r}",
              file=sys.stderr)
        return 2
    try:
        model = scoring.load_model(args.model, DTYPES[args.dtype])
        if ids is None:
            ids = scoring.tokenize(args.model, args.text, model.cfg)
        result = scoring.score(model, ids)
    except (CheckpointError, ValueError) as exc:
        print(f"kvmesh score: {exc}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    print(f"perplexity {scoring.perplexity(result):.6g} over {len(ids) - 1} predicted tokens",
          file=sys.stderr)
    return 0
