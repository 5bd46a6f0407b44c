"""Time to first token: cold prefill vs snapshot hit vs block hit + bounded replay.

Tiny model on the CPU, YOCO truncation compact with KEEP = 134. For a prompt of
L tokens the reusable prefix is L1 = floor((L - 134) / 128) * 128; a warm-up
request of L1 + 1 tokens puts those blocks in the ledger and (for the snapshot
case) stores the window at L1.

    cold          nothing cached: all L tokens computed
    snapshot hit  blocks + window at L1: L - L1 tokens computed
    replay        blocks only: L - L1 + 128 tokens computed, window truncated at L1 - 128

Targets: cold / replay >= 20x at 16K; replay / snapshot <= 2.5x at every L.
Usage: python bench/replay_ttft.py [--lengths 1024,4096,16384,65536]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, parser, plot, table  # noqa: E402
from services.engine.build import default_weights  # noqa: E402
from services.engine.config import (
    TINY,  # noqa: E402
    EngineConfig,  # noqa: E402
)
from services.engine.core.engine import EngineCore  # noqa: E402
from services.engine.core.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def engine(length: int, policy: str) -> EngineCore:
    ecfg = EngineConfig(num_slots=2, num_blocks=length // 128 + 16, max_batched_tokens=512,
                        truncation="compact", keep_tokens=134, swa_policy=policy)
    return EngineCore(TINY, ecfg, weights=WEIGHTS)


def ttft(core: EngineCore, prompt: list[int]) -> tuple[float, object]:
    seq = core.add_request(prompt, ONE)
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - t0, seq


def measure(length: int, repeats: int) -> dict[str, float]:
    prompt = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    l1 = (length - 134) // 128 * 128
    out = {}
    out["cold"] = min(ttft(engine(length, "full"), prompt)[0] for _ in range(repeats))
    for name, policy in (("snapshot", "full"), ("replay", "zero")):
        core = engine(length, policy)
        ttft(core, prompt[: l1 + 1])                 # warm-up: blocks (and window) up to L1
        times = []
        for _ in range(repeats):
            t, seq = ttft(core, prompt)
            assert seq.cached_tokens == l1, (name, seq.cached_tokens, l1)
            assert (seq.replayed_tokens > 0) == (name == "replay")
            times.append(t)
        out[name] = min(times)
    return out


# The shipped checkpoint unless --random-weights (set by main; timing does not depend on it).
WEIGHTS = None


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,65536")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--random-weights", action="store_true", help="seeded random weights")
    args = ap.parse_args(argv)
    global WEIGHTS
    WEIGHTS = default_weights("tiny", args.random_weights)
    torch.set_num_threads(2)
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {}
    measure(512, 1)      # warm-up: first calls pay for lazy initialisation in torch
    for n in lengths:
        print(f"L={n} ...", flush=True)
        results[n] = measure(n, args.repeats if n <= 16384 else 1)
        r = results[n]
        print(f"  cold {r['cold']:.3f}s  snapshot {r['snapshot']:.3f}s  replay {r['replay']:.3f}s",
              flush=True)
    rows = [[n, r["cold"], r["snapshot"], r["replay"], r["cold"] / r["replay"],
             r["replay"] / r["snapshot"]] for n, r in results.items()]
    print()
    print(table(["L", "cold s", "snapshot s", "replay s", "cold/replay", "replay/snapshot"], rows))
    print("\ntargets: cold/replay >= 20x at 16K; replay/snapshot <= 2.5x at every L")
    path = plot(OUT / "replay_ttft.png", "TTFT, tiny model on CPU", "prompt tokens L", "seconds",
                {k: (lengths, [results[n][k] for n in lengths]) for k in ("cold", "snapshot", "replay")})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
