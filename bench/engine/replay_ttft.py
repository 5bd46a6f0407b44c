"""Time to first token: cold prefill vs snapshot hit vs block hit + bounded replay.

The shipped DeepSeek V4.1-layout model (models/deepseek-v41-tiny, or --model DIR) on the
CPU, served by Engine (float32, MXFP8 window rows). For a prompt of L tokens under prefill
truncation (compact, KEEP = 134) the reusable prefix is L1 = floor((L - 134) / 128) * 128,
the deepest block boundary before the decoder's cut; a first request of the whole prompt
puts its blocks in the ledger and (for the snapshot case) stores the encoder's rings at L1.

    cold          nothing cached: all L tokens computed (the decoder on the last 134)
    snapshot hit  blocks + encoder rings at L1: L - L1 tokens computed
    replay        blocks only: L - L1 + 128 tokens computed, the 128 before L1 replayed
    off, cold / off, replay    the same without truncation (no snapshots: every hit of
                  floor((L - 1) / 128) blocks replays, the decoder layers too)

Targets: cold / replay >= 20x at 16K; replay / snapshot <= 2.5x at every L.
Usage: python -m bench.engine.replay_ttft [--lengths 1024,4096,16384,65536] [--model DIR]
"""

from __future__ import annotations

import sys

import torch

from bench.common import OUT, load_model, parser, plot, table
from bench.engine.first_token import KEEP, engine, ttft
from kvmesh.shipped import DEFAULT_MODEL

CASES = ("cold", "snapshot", "replay", "off cold", "off replay")


def measure(model, tok, length: int, repeats: int) -> dict[str, float]:
    prompt = torch.randint(0, model.cfg.vocab_size, (length,),
                           generator=torch.Generator().manual_seed(length)).tolist()
    hits = {"compact": (length - KEEP) // 128 * 128, "off": (length - 1) // 128 * 128}
    out = {}
    for name, policy, truncation in (("cold", "full", "compact"), ("off cold", "zero", "off")):
        out[name] = min(ttft(engine(model, tok, length, policy, truncation), prompt)[0]
                        for _ in range(repeats))
    for name, policy, truncation in (("snapshot", "full", "compact"), ("replay", "zero", "compact"),
                                     ("off replay", "zero", "off")):
        core = engine(model, tok, length, policy, truncation)
        ttft(core, prompt)                      # its blocks (and the rings at L1) cached
        times = []
        for _ in range(repeats):
            t, req = ttft(core, prompt)
            assert req.cached_tokens == hits[truncation], (name, req.cached_tokens)
            assert (req.replayed_tokens > 0) == name.endswith("replay"), name
            times.append(t)
        out[name] = min(times)
    return out


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,65536")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a V4.1 checkpoint directory")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {}
    measure(model, tok, 512, 1)      # warm-up: first calls pay for lazy initialisation in torch
    for n in lengths:
        print(f"L={n} ...", flush=True)
        results[n] = r = measure(model, tok, n, args.repeats if n <= 16384 else 1)
        print("  " + "  ".join(f"{k} {r[k]:.3f}s" for k in CASES), flush=True)
    rows = [[n, *(r[k] for k in CASES), r["cold"] / r["replay"], r["replay"] / r["snapshot"],
             r["off cold"] / r["off replay"]] for n, r in results.items()]
    print()
    print(table(["L", *(f"{k} s" for k in CASES), "cold/replay", "replay/snapshot",
                 "off: cold/replay"], rows))
    print("\ntargets: cold/replay >= 20x at 16K; replay/snapshot <= 2.5x at every L")
    path = plot(OUT / "replay_ttft.png", "TTFT, deepseek-v41-tiny on CPU", "prompt tokens L",
                "seconds", {k: (lengths, [results[n][k] for n in lengths]) for k in CASES})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
