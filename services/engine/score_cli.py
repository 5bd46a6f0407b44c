"""`kvmesh score`: a checkpoint's full forward over ids or text, as JSON."""

from __future__ import annotations

import json
import sys

from kvmesh.services.engine.model.deepseek_v4.checkpoint import DTYPES
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError


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
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="DeepSeek V4 / V4.1: split the model over this many ranks by tensor "
                   "parallelism (docs/design.md §15); started here, or joined from an external "
                   "launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT")
    p.add_argument("--expert-parallel", type=int, default=1,
                   help="DeepSeek V4 / V4.1: split the routed experts over this many ranks, times "
                   "--tensor-parallel")
    p.set_defaults(func=_score)


def _score_split(args, ids: list[int] | None, tp: int, ep: int) -> dict | None:
    """The score computed by a model split tp x ep (checked here before any rank starts)."""
    from kvmesh.checkpoint_dir import is_v41
    from kvmesh.services.engine import ranks
    from kvmesh.services.engine.model.deepseek_v4 import score as scoring
    from kvmesh.services.engine.model.deepseek_v4.config import read_config
    from kvmesh.services.engine.model.deepseek_v4.parallel import Split
    from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config

    cfg = (read_v41_config if is_v41(args.model) else read_config)(args.model)
    Split(tp, ep, 0).check(cfg)
    if ids is None:
        ids = scoring.tokenize(args.model, args.text, cfg)
    scoring.check_ids(ids, cfg.vocab_size)
    return ranks.run(_score_rank, (args.model, args.dtype, ids), tp, ep)


def _score_rank(split, directory: str, dtype: str, ids: list[int]) -> dict:
    """One rank: its share of the checkpoint, the split forward (every rank gets the logits)."""
    from kvmesh.services.engine.model.deepseek_v4 import score as scoring

    return scoring.score(scoring.load_model(directory, DTYPES[dtype], split), ids)


def _score(args) -> int:
    from kvmesh.services.engine.model.deepseek_v4 import score as scoring

    if (args.ids is None) == (args.text is None):
        print("kvmesh score: give either TEXT or --ids", file=sys.stderr)
        return 2
    try:
        ids = [int(t) for t in args.ids.split(",")] if args.ids is not None else None
    except ValueError:
        print(f"kvmesh score: --ids must be comma-separated integers, got {args.ids!r}",
              file=sys.stderr)
        return 2
    from torch.multiprocessing.spawn import ProcessException

    from kvmesh.services.engine import ranks


    split = (args.tensor_parallel, args.expert_parallel)
    try:
        if split != (1, 1):
            result = _score_split(args, ids, *split)
            if result is None:           # a rank other than 0 of an external launcher's group
                return 0
        else:
            model = scoring.load_model(args.model, DTYPES[args.dtype])
            if ids is None:
                ids = scoring.tokenize(args.model, args.text, model.cfg)
            result = scoring.score(model, ids)
    except (CheckpointError, ValueError) as exc:
        print(f"kvmesh score: {exc}", file=sys.stderr)
        return 2
    except ProcessException as exc:     # a rank failed; the others were ended
        print(f"kvmesh score: a rank failed: {ranks.failure(exc)}", file=sys.stderr)
        return 1
    ids = result["ids"]
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    print(f"perplexity {scoring.perplexity(result):.6g} over {len(ids) - 1} predicted tokens",
          file=sys.stderr)
    return 0
