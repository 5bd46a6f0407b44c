"""Prefill truncation on a DeepSeek V4.1 checkpoint: how far apart are `mask`, `compact` and
`off`?

One prompt of seeded random ids and its continuation, the same weights in every mode. The
continuation's logits are teacher-forced through the engine's ledger forward
(v41_ledgers.step: the prompt prefilled with the consumer layers from L - KEEP, then one
decode row per continuation token), and the per-position L2 distance of the logits is
printed for

    mask    vs compact   (the same function: must agree to floating-point noise)
    off     vs compact   (truncation is an approximation: a measured distance)

over the last prompt position and the teacher-forced positions; then Engine greedy-decodes
the continuation's length free-running in each mode (--truncation MODE) and the agreement is
counted.

    python -m bench.quality.truncation [--model DIR] [--length 600] [--keep 134] [--decode 32]

--model defaults to the shipped model. --json also writes the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.common import load_model, parser, random_ids, table
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.shipped import DEFAULT_MODEL

MODES = ("off", "mask", "compact")


def l2_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1)


def summarize(name: str, d: torch.Tensor) -> dict:
    return {"pair": name, "max": float(d.max()), "mean": float(d.mean()),
            "first": float(d[0]), "last": float(d[-1])}


def forced_logits(model, prompt: list[int], cont: list[int], mode: str, keep: int) -> torch.Tensor:
    """[len(cont), V]: row 0 predicts cont[0] from the prompt, row i cont[i] from cont[:i]."""
    from kvmesh.services.engine.model.deepseek_v4 import window_rows
    from kvmesh.services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, step

    rows = window_rows.for_dtype(model.dtype)
    led = V41Ledgers(model.cfg, 1, -(-(len(prompt) + len(cont)) // 128), rows=rows,
                     dtype=model.dtype)
    seq = led.open()
    cut = None if mode == "off" else len(prompt) - keep
    form = "compact" if mode == "off" else mode
    (first,) = step(model, led, [(seq, prompt)], [cut], form)
    logits = [first[-1:]]
    for token in cont[:-1]:
        logits += step(model, led, [(seq, [token])], [cut], form)
    return torch.cat(logits)


def greedy(model, tok, prompt: list[int], n: int, mode: str, keep: int) -> list[int]:
    """Engine's free-running greedy tokens with truncation `mode` (the model as loaded)."""
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.core.engine import Engine

    ecfg = EngineConfig(num_blocks=64, dtype=str(model.dtype).removeprefix("torch."),
                        **({} if mode == "off" else {"truncation": mode, "keep_tokens": keep}))
    core = Engine(model, ecfg, tok, name="truncation")
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while core.has_work:
        core.step()
    return req.output


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a DeepSeek V4.1 checkpoint directory")
    ap.add_argument("--length", type=int, default=600, help="prompt tokens")
    ap.add_argument("--keep", type=int, default=134, help="KEEP: prompt tokens the consumer layers run on")
    ap.add_argument("--decode", type=int, default=32, help="continuation tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt's ids")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    from kvmesh.checkpoint_dir import is_v41
    from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError

    if not is_v41(args.model):
        print(f"truncation: {args.model} is not a DeepSeek V4.1 checkpoint (prefill truncation "
              "is V4.1's)", file=sys.stderr)
        return 2
    try:
        model, tok = load_model(args.model, getattr(torch, args.dtype))  # rows as the engine keeps them
    except CheckpointError as exc:
        print(f"truncation: {exc}", file=sys.stderr)
        return 2
    text = random_ids(args.length + args.decode, args.seed, model.cfg.vocab_size)
    prompt, cont = text[:args.length], text[args.length:]
    print(f"{args.model}: seeded random ids, L={args.length}, KEEP={args.keep}, truncation "
          f"start s={args.length - args.keep}, {args.dtype}", flush=True)
    logits = {}
    tokens = {}
    for mode in MODES:
        logits[mode] = forced_logits(model, prompt, cont, mode, args.keep)
        tokens[mode] = greedy(model, tok, prompt, args.decode, mode, args.keep)
        print(f"  {mode}: done", flush=True)
    rows = [summarize("logits mask-compact", l2_rows(logits["mask"], logits["compact"])),
            summarize("logits off-compact", l2_rows(logits["off"], logits["compact"]))]
    norm = float(logits["off"].norm(dim=-1).mean())
    print(f"\nper-position L2 distance of the logits over the last prompt position and "
          f"{args.decode - 1} teacher-forced positions (mean row norm {norm:.3f})")
    print(table(["pair", "max", "mean", "at L-1", "at end"],
                [[r["pair"], *(f"{r[k]:.3e}" for k in ("max", "mean", "first", "last"))]
                 for r in rows]))
    agree = {pair: sum(a == b for a, b in zip(tokens[x], tokens["compact"], strict=True))
             for pair, x in (("mask-compact", "mask"), ("off-compact", "off"))}
    print(f"\ngreedy tokens over {args.decode} decode steps (engine):")
    for k, v in agree.items():
        print(f"  {k:<14}{v}/{args.decode} agree")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "agree": agree}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
