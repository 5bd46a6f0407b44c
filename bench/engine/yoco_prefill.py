"""Prefill time with YOCO truncation (`compact`, KEEP = 134) vs `off`, same prompt.

With truncation the decoder half of the layers runs only over the last KEEP
prompt tokens (their compressed entries are still projected from H_enc for
every token). Target: compact / off <= 0.6 at 8K tokens.
Usage: python -m bench.engine.yoco_prefill [--length 8192] [--repeats 3]
"""

from __future__ import annotations

import sys
import time

import torch

from bench.common import OUT, parser, plot, table
from services.engine.build import default_weights
from services.engine.config import (
    TINY,
    EngineConfig,
)
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams


def prefill_time(mode: str, prompt: list[int]) -> float:
    ecfg = EngineConfig(num_slots=1, num_blocks=len(prompt) // 128 + 8, max_batched_tokens=512,
                        truncation=mode, keep_tokens=134 if mode != "off" else 0, swa_policy="zero")
    core = EngineCore(TINY, ecfg, weights=WEIGHTS)
    core.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - t0


# The shipped checkpoint unless --random-weights (set by main; timing does not depend on it).
WEIGHTS = None


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random-weights", action="store_true", help="seeded random weights")
    args = ap.parse_args(argv)
    global WEIGHTS
    WEIGHTS = default_weights("tiny", args.random_weights)
    torch.set_num_threads(2)
    prefill_time("off", list(range(256)))          # warm-up
    lengths = [int(x) for x in args.lengths.split(",")]
    res = {}
    for n in lengths:
        prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        res[n] = {m: min(prefill_time(m, prompt) for _ in range(args.repeats))
                  for m in ("off", "mask", "compact")}
        print(f"L={n}: " + "  ".join(f"{m} {t:.3f}s" for m, t in res[n].items()), flush=True)
    rows = [[n, r["off"], r["mask"], r["compact"], r["compact"] / r["off"]] for n, r in res.items()]
    print()
    print(table(["L", "off s", "mask s", "compact s", "compact/off"], rows))
    print("\ntarget: compact/off <= 0.6 at 8K")
    path = plot(OUT / "yoco_prefill.png", "Prefill time, tiny model on CPU", "prompt tokens",
                "seconds", {m: (lengths, [res[n][m] for n in lengths]) for m in ("off", "mask", "compact")})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
