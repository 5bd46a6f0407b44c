"""Kernel bandwidth: achieved GB/s and fraction of the device's peak memory bandwidth, for the
Triton kernels the DeepSeek V4 engine calls.

    mxfp8_quant  quantize N window rows of 512 fp32 into 528-byte MXFP8 rows
    moe_grouped  the routed experts' grouped product: rows sorted by expert, each expert's
                 [M, K] weight over its own rows (V4-Flash widths: K 4096, M 2048)

Bytes are what each kernel must move at least (inputs read once, outputs written once);
GB/s = bytes / median time. Each row is timed for the Triton kernel and the torch
reference on the same device, and the ratio is printed. Peak: the spec figure for known
GPUs (--peak-gbs overrides); on CPU the speed of a large tensor copy stands in.

On a GPU:  python -m bench.kernels.bandwidth
On CPU:    python -m bench.kernels.bandwidth --smoke   (tiny sizes; Triton under its interpreter,
           so the Triton column there says nothing about speed: it checks the script runs)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:                       # before triton is imported: Triton runs in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import OUT, parser, plot, table  # noqa: E402
from kvmesh.kernels import moe, mxfp8  # noqa: E402
from kvmesh.kernels.triton import moe as tri_moe  # noqa: E402
from kvmesh.kernels.triton import mxfp8 as tri_mx  # noqa: E402

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


def quant_case(tokens: int, dev: str, dim: int):
    x = torch.randn(tokens, dim, device=dev)
    nbytes = tokens * (dim * 4 + dim + dim // 32)
    return (lambda: tri_mx.quantize(x)), (lambda: mxfp8.quantize_torch(x)), nbytes


def moe_case(rows: int, dev: str, experts: int, k: int, m: int):
    """`rows` (token, expert) pairs spread evenly over `experts` experts of [m, k] weights."""
    g = torch.Generator(device=dev).manual_seed(rows)
    offsets = [rows * e // experts for e in range(experts + 1)]
    x = torch.randn(rows, k, device=dev, generator=g)
    w = torch.randn(experts, m, k, device=dev, generator=g) * 0.02
    used = sum(1 for e in range(experts) if offsets[e + 1] > offsets[e])
    nbytes = 4 * (rows * k + used * m * k + rows * m)     # rows, the used experts' weights, out
    return (lambda: tri_moe.grouped_linear(x, offsets, w)), \
        (lambda: moe.grouped_linear_torch(x, offsets, w)), nbytes


def main(argv=None):
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU check)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None)
    args = ap.parse_args(argv)
    smoke = args.smoke or not CUDA
    dev = "cuda" if CUDA else "cpu"
    reps = args.repeats or (2 if smoke else 20)
    peak, peak_src = peak_gbs(dev, args.peak_gbs)
    if smoke:   # same code paths, shapes small enough for the interpreter
        dim, quant_tokens = 64, [64]
        moe_shape, moe_rows = dict(experts=4, k=64, m=32), [8, 32]
    else:
        dim, quant_tokens = 512, [1024, 16384, 131072]
        moe_shape, moe_rows = dict(experts=16, k=4096, m=2048), [16, 128, 1024, 8192]

    cases = [(f"mxfp8_quant n={n}", *quant_case(n, dev, dim)) for n in quant_tokens]
    cases += [(f"moe_grouped rows={r}", *moe_case(r, dev, **moe_shape)) for r in moe_rows]
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
    stem = "kernels_smoke" if smoke else "kernels"
    out = OUT / f"{stem}.json"
    out.write_text(json.dumps(dict(device=device, peak_gbs=peak, peak_source=peak_src,
                                   date=time.strftime("%Y-%m-%d", time.gmtime()),
                                   rows=records), indent=1))
    print(f"wrote {out} and {_plot(records, OUT / f'{stem}_moe.png', device)}")


def _plot(records: list[dict], path: Path, device: str) -> Path:
    """GB/s of the grouped expert product against its rows, Triton and torch."""
    mine = [r for r in records if r["case"].startswith("moe_grouped")]
    xs = [int(r["case"].split("rows=")[1]) for r in mine]
    series = {"moe_grouped triton": (xs, [r["gbs"] for r in mine]),
              "moe_grouped torch": (xs, [r["bytes"] / r["torch_us"] / 1e3 for r in mine])}
    return plot(path, f"grouped expert products ({device})", "rows", "GB/s", series)


if __name__ == "__main__":
    main()
