"""Decode step at batch 32 over batch 1, measured so that the machine's drift cancels (issue 11).

The throughput bench times batch 1 and batch 32 minutes apart, and on a shared 2-core VM the
machine's speed moves by up to 2x between them, so one run's ratio can land anywhere from
1.7x to 2.5x. Here one process holds two engines (tiny preset, fp32, 256-token prompts, every
sequence decoding): one with 1 sequence, one with 32. Each round times a block of steps of
each, back to back, and keeps their ratio; the result is the median over rounds (with its
quartiles). `--before DIR` runs the same measurement on an older checkout (a subprocess with
PYTHONPATH=DIR), the two trees taking turns `--runs` times, and prints them side by side:

    python bench/step_ratio.py [--before /old/checkout] [--runs 3] [--rounds 30] [--threads 2]
                               [--split]

`--split` also times each engine's block on one thread in every round and prints each
batch's step as a serial part and a parallel part (amdahl): what a second core cannot
speed up, and how much of it grows with the batch.

Only public EngineCore calls (through bench/engine_throughput.py's helpers), so an older tree
measures with its own engine. Writes bench/out/step_ratio.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, parser, plot, table  # noqa: E402

STEPS = 6            # steps per block; a round is one block at batch 1 and one at batch 32
BATCHES = (1, 32)


def measure(rounds: int, split: bool = False) -> dict:
    """This process's tree: {'b1_ms', 'b32_ms' (medians), 'ratio', 'q1', 'q3'}. With `split`,
    each round also times both batches on one thread, and 'split' holds, per batch, the
    step's serial and parallel parts (see amdahl)."""
    import torch

    from bench import engine_throughput as et

    def decoding(b: int):
        core = et.engine(b, 256)
        for i in range(b):
            core.add_request(et.prompt(256, i), et.params(10_000))
        while not et.decoding_only(core):
            core.step()
        for _ in range(5):
            core.step()
        return core

    def block(core) -> float:
        core.step()                             # the other engine's step just ran: not timed
        t0 = time.perf_counter()
        for _ in range(STEPS):
            core.step()
        return (time.perf_counter() - t0) / STEPS

    threads = torch.get_num_threads()
    cores = {b: decoding(b) for b in BATCHES}
    times: dict[int, list[float]] = {b: [] for b in BATCHES}
    single: dict[int, list[float]] = {b: [] for b in BATCHES}
    ratios = []
    for r in range(rounds):
        for b, core in cores.items():
            times[b].append(block(core))
            if split:
                torch.set_num_threads(1)
                single[b].append(block(core))
                torch.set_num_threads(threads)
        ratios.append(times[32][-1] / times[1][-1])
        if (r + 1) % 10 == 0:
            print(f"  round {r + 1}/{rounds}: ratio so far {statistics.median(ratios):.3f}",
                  file=sys.stderr, flush=True)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    out = {"b1_ms": statistics.median(times[1]) * 1e3, "b32_ms": statistics.median(times[32]) * 1e3,
           "ratio": statistics.median(ratios), "q1": q1, "q3": q3}
    if split:
        out["split"] = {b: amdahl(statistics.median(single[b]) * 1e3,
                                  statistics.median(times[b]) * 1e3, threads) for b in BATCHES}
    return out


def amdahl(t1_ms: float, tn_ms: float, n: int) -> dict:
    """A step taking t1 on one thread and tn on n, read as serial + parallel / n: the parallel
    part (in one thread's time) is (t1 - tn) * n / (n - 1), the serial part the rest. Serial
    is whatever does not speed up with threads: Python, single-threaded ops, and reads that
    a second thread cannot speed up (memory bandwidth)."""
    parallel = (t1_ms - tn_ms) * n / (n - 1)
    return {"t1_ms": t1_ms, "tn_ms": tn_ms, "serial_ms": t1_ms - parallel, "parallel_ms": parallel}


def _child(tree: Path, rounds: int, threads: int, split: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # this script runs in the child, whichever tree it measures (an older one has no --split)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--rounds",
                          str(rounds), "--threads", str(threads)] + (["--split"] if split else []),
                         cwd=tree, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--before", help="an older checkout, measured in turns with this one")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree (taking turns)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--split", action="store_true",
                    help="also time each batch on one thread and print its serial and parallel "
                         "parts (needs --threads > 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.split and args.threads < 2:
        ap.error("--split compares one thread with --threads: give --threads 2 or more")
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.rounds, args.split)))
        return 0
    here = Path(__file__).resolve().parents[1]
    trees = ([("before", Path(args.before).resolve())] if args.before else []) + [("after", here)]
    res: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for run in range(args.runs):
        for name, tree in trees:
            print(f"run {run + 1}/{args.runs}: {name} ({tree})", flush=True)
            res[name].append(_child(tree, args.rounds, args.threads, args.split))
    print(f"\nbatch 32 / batch 1 decode step, median of {args.rounds} alternating rounds per run "
          f"({args.threads} threads, wall clock)")
    print(table(["tree", "run", "b1 ms", "b32 ms", "ratio", "q1", "q3"],
                [[name, i + 1, r["b1_ms"], r["b32_ms"], r["ratio"], r["q1"], r["q3"]]
                 for name, runs in res.items() for i, r in enumerate(runs)]))
    for name, runs in res.items():
        print(f"{name}: median ratio over runs {statistics.median(r['ratio'] for r in runs):.3f} "
              f"(target <= 2)")
    if args.split:
        print(f"\nserial and parallel parts of a step (medians per run; parallel in one thread's "
              f"time: (t1 - t{args.threads}) x {args.threads} / {args.threads - 1}; serial = t1 - "
              f"parallel: Python, single-threaded ops, bandwidth-bound reads)")
        print(table(["tree", "run", "batch", "1 thread ms", f"{args.threads} threads ms", "serial ms",
                     "parallel ms"],
                    [[name, i + 1, b, sp["t1_ms"], sp["tn_ms"], sp["serial_ms"], sp["parallel_ms"]]
                     for name, runs in res.items() for i, r in enumerate(runs)
                     for b, sp in r["split"].items()]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "step_ratio.json").write_text(json.dumps(res, indent=1))
    path = plot(OUT / "step_ratio.png", "decode step, batch 32 / batch 1 (drift-cancelled)", "run",
                "ratio", {name: (list(range(1, len(runs) + 1)), [r["ratio"] for r in runs])
                          for name, runs in res.items()}, logx=False, logy=False)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
