"""How much slower a decode step's small ops and weight products run inside the step than
alone, at batch 1 and at a larger batch (issue 11).

A step runs a few hundred small torch ops (index building, RoPE angles, norms) between
kernels that stream the weights (17 MB for tiny, fp32) and, at a large batch, as many bytes
of MXFP8 ring rows. A small op costs what its code and data cost to bring back into the
caches, so its time alone says little about its time in the step. Measured here:

  probe      a fixed small routine: the RoPE angles of 32 positions (ops.rope_angles, ten
             small torch ops), timed
               - alone, repeated (its code and data in cache),
               - alone right after reading S MB of memory (S in --sweeps),
               - inside decode steps, just before each of the step's own rope_angles calls,
                 at batch 1 and at batch --batch (two engines in one process, taking turns
                 in blocks of steps so that a drifting machine load hits both alike);
  products   the step's weight products (ops.mm) as they run, and with each weight read
             once just before its product (untimed): the difference is what they spend
             waiting for memory.

If the probe costs the same inside steps of both batches, a step's fixed costs do not grow
with the batch (only per-row work then can), and if the products' waiting is the same at
both batches, their growth is their arithmetic.

    python bench/step_probe.py [--batch 32] [--rounds 30] [--steps 3] [--threads 2]
                               [--sweeps 16,24,40,64] [--prompt 256]

Writes bench/out/step_probe.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, parser, plot, table  # noqa: E402
from bench.engine_throughput import decoding_only, engine, params, prompt  # noqa: E402
from services.engine.config import TINY  # noqa: E402
from services.engine.model import ops  # noqa: E402

PROBE_POS = torch.arange(300, 332)
ROPE_ANGLES = ops.rope_angles        # the probe calls this, never the step's wrapped one


def probe() -> float:
    """Seconds of one probe call."""
    t0 = time.perf_counter()
    ROPE_ANGLES(PROBE_POS, TINY, torch.float32)
    return time.perf_counter() - t0


def alone(rounds: int, sweeps: list[int]) -> dict[str, float]:
    """Median probe seconds alone: repeated ('hot') and after reading each sweep's MB."""
    out = {"hot": statistics.median(probe() for _ in range(rounds * 10))}
    for mb in sweeps:
        big = torch.ones(mb << 18)              # mb MB of float32
        times = []
        for _ in range(rounds * 2):
            big.sum()
            times.append(probe())
        out[f"after {mb} MB"] = statistics.median(times)
    return out


class Taps:
    """The step's rope_angles and weight products, wrapped: each rope_angles call runs the
    probe first (timed into `probes`); each product is timed (`mm_s`), after one untimed
    product of the same weight when `warm` is set."""

    def __init__(self):
        self.rope, self.mm = ops.rope_angles, ops.mm
        self.probes: list[float] = []
        self.mm_s, self.mm_calls, self.warm = 0.0, 0, False

    def __enter__(self):
        def rope_angles(pos, cfg, dtype):
            self.probes.append(probe())
            return self.rope(pos, cfg, dtype)

        def mm(x, w):
            if self.warm:
                self.mm(x, w)
            t0 = time.perf_counter()
            out = self.mm(x, w)
            self.mm_s += time.perf_counter() - t0
            self.mm_calls += 1
            return out
        ops.rope_angles, ops.mm = rope_angles, mm
        return self

    def __exit__(self, *exc):
        ops.rope_angles, ops.mm = self.rope, self.mm


def decoding(b: int, prompt_len: int):
    core = engine(b, prompt_len)
    for i in range(b):
        core.add_request(prompt(prompt_len, i), params(10_000))
    while not decoding_only(core):
        core.step()
    for _ in range(3):
        core.step()
    return core


def in_steps(batches: list[int], prompt_len: int, rounds: int, steps: int) -> dict:
    """Per batch: the probe's median seconds inside its steps, the step's median seconds
    (less the probes' time), and the products' seconds a step as they run and warmed (medians
    over rounds)."""
    cores = {b: decoding(b, prompt_len) for b in batches}
    got = {b: {"probe": [], "step": [], "mm": [], "mm_warm": []} for b in batches}
    with Taps() as taps:
        for r in range(rounds):
            for warm in (False, True) if r % 2 else (True, False):
                taps.warm = warm
                for b, core in cores.items():
                    core.step()                     # the other engine's step just ran
                    taps.probes.clear()
                    taps.mm_s, taps.mm_calls = 0.0, 0
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        core.step()
                    g = got[b]
                    if not warm:        # a warming product would be in the step's time
                        # the step less the probes it ran
                        g["step"].append((time.perf_counter() - t0 - sum(taps.probes)) / steps)
                        g["probe"] += taps.probes
                    g["mm_warm" if warm else "mm"].append(taps.mm_s / steps)
                    if not taps.probes or not taps.mm_calls:
                        raise SystemExit("the engine no longer calls ops.rope_angles and "
                                         "ops.mm in a decode step: this bench needs updating")
    return {b: {k: statistics.median(v) for k, v in g.items()} | {"probes": len(g["probe"])}
            for b, g in got.items()}


def batch_args(description: str, steps: int) -> argparse.ArgumentParser:
    """The arguments of the benches that time batch 1 against a larger batch in one process
    (this one and step_pieces.py)."""
    ap = parser(description)
    ap.add_argument("--batch", type=int, default=32, help="the larger batch (beside 1)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    return ap


def main(argv=None) -> int:
    ap = batch_args(__doc__.splitlines()[0], steps=3)
    ap.add_argument("--sweeps", default="16,24,40,64", help="MB read before the probe alone")
    args = ap.parse_args(argv)
    if args.batch < 2 or args.rounds < 2 or args.steps < 1:
        ap.error("--batch and --rounds must be at least 2, --steps at least 1")
    torch.set_num_threads(args.threads)
    sweeps = [int(s) for s in args.sweeps.split(",") if s]
    batches = [1, args.batch]
    steps = in_steps(batches, args.prompt, args.rounds, args.steps)
    solo = alone(args.rounds, sweeps)
    hot = solo["hot"]
    print(f"probe (RoPE angles of 32 positions, ten small torch ops), {args.threads} thread(s), "
          "medians")
    rows = [[where, s * 1e6, s / hot] for where, s in solo.items()]
    rows += [[f"in batch-{b} steps", steps[b]["probe"] * 1e6, steps[b]["probe"] / hot]
             for b in batches]
    print(table(["where", "us", "x alone hot"], rows))
    print(f"\nthe step and its weight products, ms a step (medians of {args.rounds} rounds)")
    print(table(["batch", "step", "products", "products warmed", "waiting for memory"],
                [[b, steps[b]["step"] * 1e3, steps[b]["mm"] * 1e3, steps[b]["mm_warm"] * 1e3,
                  (steps[b]["mm"] - steps[b]["mm_warm"]) * 1e3] for b in batches]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "step_probe.json").write_text(json.dumps(
        {"args": vars(args), "alone_s": solo, "in_steps": {str(b): v for b, v in steps.items()}},
        indent=1))
    path = plot(OUT / "step_probe.png", "a small routine alone after reading memory, and in steps",
                "MB read before it", "us", {
                    "alone": (sweeps, [solo[f"after {mb} MB"] * 1e6 for mb in sweeps]),
                    **{f"in batch-{b} steps": (sweeps, [steps[b]["probe"] * 1e6] * len(sweeps))
                       for b in batches}}, logy=False)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
