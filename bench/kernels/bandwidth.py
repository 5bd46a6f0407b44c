"""Kernel bandwidth: achieved GB/s and fraction of the device's peak memory bandwidth.

    swa_decode   ring_attention, one decode row per sequence, v41-flash geometry per layer
                 (64 heads x 512, W 128, ring 134 rows of 528 B), batch 1..128
    ragged_swa   the engine's op (kernels.ragged.ragged_union_attention): decode rows reading
                 their slot's MXFP8 ring in place (Triton) vs the torch op on the fp32 mirror
    ragged_csa   the same plus each row's 512 CSA picks (fp32 entries) in the one softmax
    mxfp8_quant  quantize N tokens of 512 fp32 into 528-byte rows
    indexer_topk indexer scores (64 heads x 128) over Kc entries + top-k (512) per row

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
from kernels import attention, indexer, mxfp8, ragged  # noqa: E402
from kernels.triton import attention as tri_att  # noqa: E402
from kernels.triton import indexer as tri_idx  # noqa: E402
from kernels.triton import mxfp8 as tri_mx  # noqa: E402
from kernels.triton import ragged as tri_rg  # noqa: E402

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


def ragged_case(batch: int, dev: str, heads: int, dim: int, window: int, picks: int,
                parts: int | None = None):
    """Decode rows of `batch` slots attending to their 134-row rings in place (the window's
    W rows visible), plus `picks` per-row CSA entries when > 0. `parts`: the Triton kernel's
    split over keys (None: its own choice, which splits small batches; 1: never)."""
    ring_rows = window + 6
    g = torch.Generator(device=dev).manual_seed(batch)
    codes = mxfp8.quantize_torch(torch.randn(batch, ring_rows, dim, device=dev, generator=g))
    ok = torch.zeros(batch, ring_rows, dtype=torch.bool, device=dev)
    ok[:, :window] = True
    ring = ragged.RingKeys(mxfp8.dequantize_torch(codes), ragged.SlotRows.build(list(range(batch)), dev),
                           ok, codes)
    groups = [ring]
    tb = dim + dim // 32
    nbytes = batch * (window * tb + 2 * heads * dim * 4 + ring_rows)
    if picks:
        groups.append((torch.randn(batch, picks, dim, device=dev, generator=g),
                       torch.ones(batch, picks, dtype=torch.bool, device=dev)))
        nbytes += batch * picks * (dim * 4 + 1)
    q = torch.randn(batch, heads, dim, device=dev, generator=g)
    sink = torch.zeros(heads, device=dev)

    def torch_op():
        os.environ["KVMESH_KERNELS"] = "torch"         # dispatch reads it on every call
        try:
            return ragged.ragged_union_attention(q, groups, sink, dim ** -0.5)
        finally:
            del os.environ["KVMESH_KERNELS"]

    return (lambda: tri_rg.union_attention(q, groups, sink, dim ** -0.5, parts=parts)), \
        torch_op, nbytes


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
        heads, dim, window, batches, picks = 2, 64, 16, [1, 4], 8
        quant_tokens, idx = [64], dict(heads=2, dim=32, entries=64, topk=8, batches=[1, 2])
    else:
        heads, dim, window, batches, picks = 64, 512, 128, [1, 2, 4, 8, 16, 32, 64, 128], 512
        quant_tokens = [1024, 16384, 131072]
        idx = dict(heads=64, dim=128, entries=8192, topk=512, batches=[1, 8, 32, 128])

    cases = [(f"swa_decode b={b}", *swa_decode_case(b, dev, heads, dim, window)) for b in batches]
    cases += [(f"ragged_swa b={b}", *ragged_case(b, dev, heads, dim, window, 0)) for b in batches]
    cases += [(f"ragged_csa b={b}", *ragged_case(b, dev, heads, dim, window, picks))
              for b in batches]
    # the same small batches with the keys not split: the split's gain side by side
    cases += [(f"ragged_csa b={b} unsplit", *ragged_case(b, dev, heads, dim, window, picks, 1))
              for b in batches if tri_rg.key_parts(b, heads, window + 6 + picks) > 1]
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
    stem = "kernels_smoke" if smoke else "kernels"
    out = OUT / f"{stem}.json"
    out.write_text(json.dumps(dict(device=device, peak_gbs=peak, peak_source=peak_src,
                                   date=time.strftime("%Y-%m-%d", time.gmtime()),
                                   rows=records), indent=1))
    print(f"wrote {out} and {_plot(records, OUT / f'{stem}_decode.png', device)}")


def _plot(records: list[dict], path: Path, device: str) -> Path:
    """GB/s of the decode attention rows against the batch, Triton and torch."""
    series = {}
    for kind in ("swa_decode", "ragged_swa", "ragged_csa"):
        mine = [r for r in records if r["case"].startswith(kind + " b=")
                and not r["case"].endswith("unsplit")]
        xs = [int(r["case"].split("b=")[1]) for r in mine]
        series[f"{kind} triton"] = (xs, [r["gbs"] for r in mine])
        series[f"{kind} torch"] = (xs, [r["bytes"] / r["torch_us"] / 1e3 for r in mine])
    unsplit = [r for r in records if r["case"].endswith("unsplit")]
    if unsplit:
        series["ragged_csa triton, keys not split"] = (
            [int(r["case"].split("b=")[1].split()[0]) for r in unsplit], [r["gbs"] for r in unsplit])
    return plot(path, f"decode attention, v41-flash layer geometry ({device})", "batch",
                "GB/s", series)


if __name__ == "__main__":
    main()
