"""YOCO prefill truncation: how far are `mask`, `compact` and `off` apart?

Same weights, same prompt. For the positions [L - KEEP, L) that truncated
prefill computes, it prints the per-position L2 distance of the final hidden
states and of the logits between

    mask    vs compact   (must agree to floating-point noise: same function)
    off     vs compact   (truncation is an approximation: a measured distance)

and then greedy-decodes N tokens with the engine in each mode and reports how
many tokens agree. Usage:

    python examples/yoco/yoco_equiv.py --length 1000 --keep 134 --decode 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.engine.config import (
    EngineConfig,  # noqa: E402
    preset,  # noqa: E402
)
from services.engine.core.engine import EngineCore  # noqa: E402
from services.engine.core.sampling import SamplingParams  # noqa: E402
from services.engine.model import reference  # noqa: E402
from services.engine.model.weights import init_weights  # noqa: E402


def l2_rows(a, b):
    return (a - b).norm(dim=-1)


def summarize(name, d):
    return {"pair": name, "max": float(d.max()), "mean": float(d.mean()),
            "first": float(d[0]), "last": float(d[-1])}


def greedy(cfg, w, prompt, mode, keep, n):
    ecfg = EngineConfig(truncation=mode, keep_tokens=keep if mode != "off" else 0,
                        dtype=str(w["embed"].dtype).replace("torch.", ""), num_blocks=1024)
    core = EngineCore(cfg, ecfg, weights=w)
    seq = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while core.has_work:
        core.step()
    return seq.output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--keep", type=int, default=134)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    cfg = preset(args.preset)
    w = init_weights(cfg, args.seed, getattr(torch, args.dtype))
    prompt = torch.randint(0, 256, (args.length,), generator=torch.Generator().manual_seed(1)).tolist()
    s = args.length - args.keep
    print(f"{cfg.name}: L={args.length}, KEEP={args.keep}, truncation start s={s}, {args.dtype}")

    off = reference.forward(w, cfg, prompt)
    mask = reference.forward(w, cfg, prompt, dec_lo=s, dec_mode="mask")
    compact = reference.forward(w, cfg, prompt, dec_lo=s, dec_mode="compact")
    rows = [
        summarize("hidden mask-compact", l2_rows(mask.hidden, compact.hidden)),
        summarize("logits mask-compact", l2_rows(mask.logits, compact.logits)),
        summarize("hidden off-compact", l2_rows(off.hidden[s:], compact.hidden)),
        summarize("logits off-compact", l2_rows(off.logits[s:], compact.logits)),
    ]
    ref_norm = float(off.logits[s:].norm(dim=-1).mean())
    print(f"\nper-position L2 distance over the {args.keep} kept positions "
          f"(mean |logits| row norm {ref_norm:.3f})")
    print(f"{'pair':<22}{'max':>12}{'mean':>12}{'at s':>12}{'at L-1':>12}")
    for r in rows:
        print(f"{r['pair']:<22}{r['max']:>12.3e}{r['mean']:>12.3e}{r['first']:>12.3e}{r['last']:>12.3e}")

    tokens = {m: greedy(cfg, w, prompt, m, args.keep, args.decode) for m in ("off", "mask", "compact")}
    agree = {
        "mask-compact": sum(a == b for a, b in zip(tokens["mask"], tokens["compact"], strict=True)),
        "off-compact": sum(a == b for a, b in zip(tokens["off"], tokens["compact"], strict=True)),
    }
    print(f"\ngreedy tokens over {args.decode} decode steps (engine):")
    for k, v in agree.items():
        print(f"  {k:<14}{v}/{args.decode} agree")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "agree": agree}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
