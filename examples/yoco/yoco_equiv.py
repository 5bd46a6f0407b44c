"""YOCO prefill truncation: how far apart are the engine's `mask`, `compact` and `off`?

Same weights (the shipped checkpoint unless --random-weights), same prompt (a held-out
stdlib file's text, never trained on), one engine per mode. Each engine decodes the
prompt's true continuation teacher-forced, so all three see the same tokens, and the
per-position L2 distance of the logits the engines produced is printed for

    mask    vs compact   (must agree to floating-point noise: same function)
    off     vs compact   (truncation is an approximation: a measured distance)

over the last prompt position and the decode positions, then each engine greedy-decodes
N tokens free-running and the agreement is counted. Usage:

    python examples/yoco/yoco_equiv.py --length 1000 --keep 134 --decode 32
    python examples/yoco/yoco_equiv.py --model DIR --length 600   # a DeepSeek V4.1 checkpoint

With --model (a DeepSeek V4.1 checkpoint directory) the prompt is seeded random token ids,
the teacher-forced logits come from the engine's ledger forward (v41_ledgers.step: the
prompt prefilled with the decoder from L - KEEP, then one decode row per continuation
token) and the greedy tokens from V4Engine with --truncation MODE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.quality.forcing import ForcingEngine  # noqa: E402
from services.engine.build import default_weights  # noqa: E402
from services.engine.config import EngineConfig, preset  # noqa: E402
from services.engine.core.sampling import SamplingParams  # noqa: E402
from services.engine.model.weights import init_weights  # noqa: E402
from training import data  # noqa: E402
from training.evaluate import held_out_stream  # noqa: E402

MODES = ("off", "mask", "compact")


def l2_rows(a, b):
    return (a - b).norm(dim=-1)


def summarize(name, d):
    return {"pair": name, "max": float(d.max()), "mean": float(d.mean()),
            "first": float(d[0]), "last": float(d[-1])}


def run_mode(cfg, w, prompt, cont, mode, keep):
    """-> (logits [len(cont), V] teacher-forced, greedy tokens) from one engine in `mode`."""
    ecfg = EngineConfig(truncation=mode, keep_tokens=keep if mode != "off" else 0,
                        dtype=str(w["embed"].dtype).replace("torch.", ""), num_blocks=256)
    core = ForcingEngine(cfg, ecfg, weights=w)
    # the continuation is scored from one prefill of prompt + continuation whose
    # truncation point is pinned to the prompt's (bench/quality/forcing.py); different
    # salts: neither request reuses the other's blocks or snapshots
    core.forced["forced"] = len(cont)
    core.add_request(prompt + cont, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                     request_id="forced", salt="forced")
    params = SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True)
    greedy = core.add_request(prompt, params, request_id="greedy", salt="greedy")
    while core.has_work:
        core.step()
    return torch.cat(core.logits["forced"]), greedy.output


def run_v41_mode(directory, model, prompt, cont, mode, keep):
    """As run_mode, for a DeepSeek V4.1 checkpoint (see the module's docstring)."""
    from services.engine.build import add_engine_args, build_core
    from services.engine.model.deepseek_v4 import window_rows
    from services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, step

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
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    flags = ["--model", str(directory), "--dtype", str(model.dtype).replace("torch.", ""),
             "--num-blocks", "64"]
    if mode != "off":
        flags += ["--truncation", mode, "--keep-tokens", str(keep)]
    core = build_core(ap.parse_args(flags))
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=len(cont),
                                                  ignore_eos=True))
    while core.has_work:
        core.step()
    return torch.cat(logits), req.output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="a DeepSeek V4.1 checkpoint directory instead of V4-mini")
    ap.add_argument("--random-weights", action="store_true",
                    help="seeded random weights instead of the shipped checkpoint")
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--keep", type=int, default=134)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    s = args.length - args.keep
    if args.model:
        from services.engine.model.deepseek_v4.errors import CheckpointError
        from services.engine.model.deepseek_v4.score import load_model
        try:
            model = load_model(args.model, dtype)
        except CheckpointError as exc:
            print(f"yoco_equiv: {exc}", file=sys.stderr)
            return 2
        g = torch.Generator().manual_seed(args.seed)
        text = torch.randint(0, model.cfg.vocab_size, (args.length + args.decode,),
                             generator=g).tolist()
        prompt, cont = text[: args.length], text[args.length:]
        print(f"{args.model} (DeepSeek V4.1, seeded random ids): L={args.length}, "
              f"KEEP={args.keep}, truncation start s={s}, {args.dtype}")
        out = {m: run_v41_mode(args.model, model, prompt, cont, m, args.keep) for m in MODES}
    else:
        cfg = preset(args.preset)
        w = None if args.random_weights else default_weights(args.preset)
        w = init_weights(cfg, args.seed, dtype) if w is None else {k: t.to(dtype) for k, t in w.items()}
        text = data.eval_windows(held_out_stream(), 1, args.length + args.decode)[0].tolist()
        prompt, cont = text[: args.length], text[args.length: args.length + args.decode]
        source = "random weights" if args.random_weights else "shipped checkpoint"
        print(f"{cfg.name} ({source}): L={args.length}, KEEP={args.keep}, truncation start s={s}, {args.dtype}")
        out = {m: run_mode(cfg, w, prompt, cont, m, args.keep) for m in MODES}
    rows = [
        summarize("logits mask-compact", l2_rows(out["mask"][0], out["compact"][0])),
        summarize("logits off-compact", l2_rows(out["off"][0], out["compact"][0])),
    ]
    ref_norm = float(out["off"][0].norm(dim=-1).mean())
    print(f"\nengine logits, per-position L2 distance over the last prompt position and "
          f"{args.decode - 1} teacher-forced decode positions (mean |logits| row norm {ref_norm:.3f})")
    print(f"{'pair':<22}{'max':>12}{'mean':>12}{'at L-1':>12}{'at end':>12}")
    for r in rows:
        print(f"{r['pair']:<22}{r['max']:>12.3e}{r['mean']:>12.3e}{r['first']:>12.3e}{r['last']:>12.3e}")

    tokens = {m: out[m][1] for m in MODES}
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
