"""Kernel bandwidth: achieved GB/s and fraction of the device's peak memory bandwidth.

    swa_decode   ring_attention, one decode row per sequence, v41-flash geometry per layer
                 (64 heads x 512, W 128, ring 134 rows of 528 B), batch 1..128
    mxfp8_quant  quantize N tokens of 512 fp32 into 528-byte rows
    indexer_topk indexer scores (64 heads x 128) over Kc entries + top-k (512) per row

Bytes are what each kernel must move at least (inputs read once, outputs written once);
GB/s = bytes / median time. Each row is timed for the Triton kernel and the torch
reference on the same device, and the ratio is printed. Peak: the spec figure for known
GPUs (--peak-gbs overrides); on CPU the speed of a large tensor copy stands in.

On a GPU:  python bench/kernels.py
On CPU:    python bench/kernels.py --smoke   (tiny sizes; Triton under its interpreter,
           so the Triton column there says nothing about speed: it checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:                       # before triton is imported: Triton runs in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, table  # noqa: E402
from kernels import attention, indexer, mxfp8  # noqa: E402
from kernels.triton import attention as tri_att  # noqa: E402
from kernels.triton import indexer as tri_idx  # noqa: E402
from kernels.triton import mxfp8 as tri_mx  # noqa: E402

# spec HBM bandwidth, GB/s (device name substring -> peak)
PEAKS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
         "A100-SXM4-80GB": 2039.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0, "A10": 600.0}


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_gbs(dev: str, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gbs"
    if CUDA:
        name = torch.cuda.get_device_name()
        for key, gbs in PEAKS.items():
            if key in name:
                return gbs, f"spec ({name})"
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    s = timed(lambda: x.clone(), 5)
    return 2 * x.numel() / s / 1e9, "measured copy"


def swa_decode_case(batch: int, dev: str, heads: int, dim: int, window: int):
    ring_rows = window + 6
    g = torch.Generator(device=dev).manual_seed(batch)
    tb = dim + dim // 32
    ring = torch.randint(0, 0x7E, (batch, ring_rows, tb), dtype=torch.uint8, device=dev,
                         generator=g)
    ring[..., dim:] = 120                                     # sane scales
    chunk = ring[:, :1].clone()
    q = torch.randn(batch, 1, heads, dim, device=dev, generator=g)
    pos = torch.full((batch, 1), 10_000, device=dev, dtype=torch.long)
    args = (q, ring, torch.arange(batch, device=dev), chunk, pos,
            torch.ones(batch, 1, dtype=torch.bool, device=dev),
            torch.zeros(batch, dtype=torch.long, device=dev), window,
            torch.zeros(heads, device=dev), dim ** -0.5)
    nbytes = batch * (window * tb + 2 * heads * dim * 4)      # window rows + q + out
    return (lambda: tri_att.ring_attention(*args)), (lambda: attention.ring_attention_torch(*args)), nbytes


def quant_case(tokens: int, dev: str, dim: int):
    x = torch.randn(tokens, dim, device=dev)
    nbytes = tokens * (dim * 4 + dim + dim // 32)
    return (lambda: tri_mx.quantize(x)), (lambda: mxfp8.quantize_torch(x)), nbytes


def indexer_case(batch: int, dev: str, heads: int, dim: int, entries: int, topk: int):
    q = torch.randn(batch, 1, heads, dim, device=dev)
    w = torch.randn(batch, 1, heads, device=dev)
    k = torch.randn(batch, entries, dim, device=dev)
    visible = torch.ones(batch, 1, entries, dtype=torch.bool, device=dev)
    nbytes = batch * (entries * dim * 4 + heads * dim * 4 + entries)

    def run(scores):
        return lambda: indexer.select_topk(scores(q, w, k), visible, topk)

    return run(tri_idx.indexer_scores), run(indexer.indexer_scores_torch), nbytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU check)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None)
    args = ap.parse_args(argv)
    smoke = args.smoke or not CUDA
    dev = "cuda" if CUDA else "cpu"
    reps = args.repeats or (2 if smoke else 20)
    peak, peak_src = peak_gbs(dev, args.peak_gbs)
    if smoke:   # same code paths, shapes small enough for the interpreter
        heads, dim, window, batches = 2, 64, 16, [1, 4]
        quant_tokens, idx = [64], dict(heads=2, dim=32, entries=64, topk=8, batches=[1, 2])
    else:
        heads, dim, window, batches = 64, 512, 128, [1, 2, 4, 8, 16, 32, 64, 128]
        quant_tokens = [1024, 16384, 131072]
        idx = dict(heads=64, dim=128, entries=8192, topk=512, batches=[1, 8, 32, 128])

    cases = [(f"swa_decode b={b}", *swa_decode_case(b, dev, heads, dim, window)) for b in batches]
    cases += [(f"mxfp8_quant n={n}", *quant_case(n, dev, dim)) for n in quant_tokens]
    cases += [(f"indexer_topk b={b} kc={idx['entries']}",
               *indexer_case(b, dev, idx["heads"], idx["dim"], idx["entries"], idx["topk"]))
              for b in idx["batches"]]
    rows, records = [], []
    for name, tri_fn, ref_fn, nbytes in cases:
        t_tri, t_ref = timed(tri_fn, reps), timed(ref_fn, reps)
        gbs = nbytes / t_tri / 1e9
        rows.append([name, nbytes, t_tri * 1e6, gbs, gbs / peak, t_ref * 1e6, t_ref / t_tri])
        records.append(dict(case=name, bytes=nbytes, triton_us=t_tri * 1e6, gbs=gbs,
                            frac_peak=gbs / peak, torch_us=t_ref * 1e6, speedup=t_ref / t_tri))
    device = torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter: not a speed)"
    print(f"device: {device}; peak {peak:.1f} GB/s ({peak_src}); median of {reps}")
    print(table(["case", "bytes", "triton us", "GB/s", "of peak", "torch us", "torch/triton"], rows))
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / ("kernels_smoke.json" if smoke else "kernels.json")
    out.write_text(json.dumps(dict(device=device, peak_gbs=peak, peak_source=peak_src,
                                   date=time.strftime("%Y-%m-%d", time.gmtime()),
                                   rows=records), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
