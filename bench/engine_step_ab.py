"""Decode step time with and without this checkout's CPU fast paths, interleaved step by step in
one process (tiny preset, fp32, 1 thread, CPU seconds), so load drift on a shared machine hits
both sides alike (a before/after of two processes minutes apart measures the neighbours).

    plain    ring attention in one pass over every slot (kernels/ragged.py RING_PASS_BYTES
             past any batch), SWA rows quantized then dequantized from their bytes
    fast     ring attention in passes of ~1 MB of rings (L2), MXFP8 codes and values in one
             pass (mxfp8.quantize_values)

Both sides compute the same numbers (tests/engine/test_ring_passes.py); the table gives the
median step per batch and fast / plain, and the step(b) / step(1) ratio of each side.

    .venv/bin/python bench/engine_step_ab.py [--steps 15] [--prompt 256]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, plot, table  # noqa: E402
from bench.engine_throughput import BATCHES, shrinking_batches  # noqa: E402
from kernels import mxfp8, ragged  # noqa: E402
from services.engine.model import ops  # noqa: E402


def _round_trip(kv):
    q = mxfp8.quantize(kv)
    return q, mxfp8.dequantize(q, kv.dtype)


@contextlib.contextmanager
def plain():
    """The paths as they were before: one pass, quantize then dequantize the bytes."""
    saved = ragged.RING_PASS_BYTES, ops.quantize_kv
    ragged.RING_PASS_BYTES, ops.quantize_kv = 1 << 62, _round_trip
    try:
        yield
    finally:
        ragged.RING_PASS_BYTES, ops.quantize_kv = saved


def measure(prompt_len: int, steps: int) -> dict[int, dict[str, float]]:
    out = {}
    for core, b in shrinking_batches(prompt_len):
        times: dict[str, list[float]] = {"plain": [], "fast": []}
        for _ in range(steps):
            for side in ("plain", "fast"):
                with plain() if side == "plain" else contextlib.nullcontext():
                    t0 = time.process_time()
                    core.step()
                    times[side].append(time.process_time() - t0)
        out[b] = {k: statistics.median(v) for k, v in times.items()}
        print(f"  batch {b}: plain {out[b]['plain'] * 1e3:.1f} ms  fast {out[b]['fast'] * 1e3:.1f} ms",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()
    res = measure(args.prompt, args.steps)
    rows = [[b, r["plain"] * 1e3, r["fast"] * 1e3, r["fast"] / r["plain"],
             r["plain"] / res[1]["plain"], r["fast"] / res[1]["fast"]] for b, r in sorted(res.items())]
    print("\ndecode step, median CPU ms (steps interleaved)")
    print(table(["batch", "plain ms", "fast ms", "fast/plain", "plain x b1", "fast x b1"], rows))
    path = plot(OUT / "engine_step_ab.png", "decode step: plain vs fast paths (tiny, fp32, 1 thread)",
                "batch", "ms", {side: (list(BATCHES), [res[b][side] * 1e3 for b in BATCHES])
                                for side in ("plain", "fast")})
    print(f"plot: {path}\nload average {load} -> {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
