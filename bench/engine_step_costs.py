"""Where a decode step's time goes, measured inside the step (issue 11): each piece's cost.

A profiler charges a cache miss to whichever op takes it, and a piece timed alone runs with
its data hot; neither says what a step would save without the piece. This bench times decode
steps of b sequences (tiny preset, fp32, in-process EngineCore, every sequence decoding) in
blocks that alternate between the real engine and the engine with ONE piece replaced by a
result of the right shape that does no work (the model's numbers become garbage; only time
is read), on the same engine state, so a load drift hits both alike:

    cost(piece, b) = mean over block pairs of (step time real - step time without the piece)

printed with its standard error. growth = cost(b) - cost(1): what the piece adds per batch.

    attention  the attention kernel of each layer's decode rows: the compiled CPU kernel over
               the MXFP8 ring bytes and the entries in place (kernels/cpu_ring.union_attention)
               where it is built, else torch's flash kernel over the fp32 mirror (_flash_ring)
    entries    compressed entries of CSA and HCA layers: block gathers, indexer, top-k picks
               (ModelRunner._compressed; their attention is the kernel's); csa / hca: one kind
               of layer only
    feed       compressor feeding: projections, tail ring, pooling, block scatter (compressor.feed);
               feed-mm: its projections only; feed-ring: its tail ring writes and reads only;
               feed-pool: pooling completed groups and scattering their entries only
    writes     the new rows' SWA ring bytes and window mirror rows (put_at); mirror: the
               mirror rows only (which the compiled kernel does not read)
    quantize   MXFP8 quantization of each layer's new kv rows (ops.quantize_kv)
    ffn        the feed-forward block (ops.ffn)
    torch-rows RMS norm and RoPE through torch's ops instead of their C calls (kernels/cpu_rows:
               the stand-in is the torch path, not nothing, so a negative cost is what the C
               calls save)

    python bench/engine_step_costs.py [--batches 1,32] [--pieces attention,entries] [--pairs 12]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.cpu_pool as cpu_pool  # noqa: E402
import kernels.cpu_ring as cpu_ring  # noqa: E402
import kernels.cpu_rows as cpu_rows  # noqa: E402
import kernels.ragged as ragged  # noqa: E402
import services.engine.model.compressor as compressor  # noqa: E402
import services.engine.model.runner as runner  # noqa: E402
import services.engine.model.window_mirror as window_mirror  # noqa: E402
from bench._common import OUT, parser, plot, table  # noqa: E402
from bench.engine_throughput import decoding_only, engine, params, prompt  # noqa: E402
from services.engine.model import ops  # noqa: E402

PIECES = ("attention", "entries", "csa", "hca", "feed", "feed-mm", "feed-ring", "feed-pool", "writes", "mirror",
          "quantize", "ffn", "torch-rows")


def _no_ring_attention(q, ring, scale):
    t, h, _ = q.shape
    return torch.zeros_like(q), torch.zeros(t, h, 1, dtype=q.dtype), \
        torch.zeros(t, 1, 1, dtype=torch.bool)


def _no_c_kernel(q, scale, **groups):
    t, h, _ = q.shape
    return torch.zeros_like(q), torch.zeros(t, h, dtype=q.dtype)


def _no_entries(kinds):
    real = runner.ModelRunner._compressed

    def fake(self, layer, seg, step, h, m, rows, per_row, key, work_ids, pool=None):
        if self.cfg.layers[layer] not in kinds:
            return real(self, layer, seg, step, h, m, rows, per_row, key, work_ids, pool)
        t = h.shape[0] if rows is None else h[rows].shape[0]
        return torch.zeros(t, 1, self.cfg.head_dim, dtype=h.dtype), \
            torch.ones(t, 1, dtype=torch.bool)
    return fake


def _no_projection(weight: str):
    def fake(w, layer, u):
        width = w[f"layers.{layer}.{weight}"].shape[1]
        return torch.zeros(u.shape[0], width, dtype=u.dtype), torch.zeros(u.shape[0], width, dtype=u.dtype)
    return fake


def _no_take(ring, at):
    return torch.zeros(at.flat.shape[0], *ring.shape[2:], dtype=ring.dtype)


def _no_quantize(kv):
    return torch.zeros(kv.shape[0], kv.shape[1] * 33 // 32, dtype=torch.uint8), kv


def patches(piece: str) -> list[tuple[object, str, object]]:
    """(owner, attribute, stand-in) for one piece."""
    nothing = lambda *a, **k: None  # noqa: E731
    return {
        "attention": [(ragged, "_flash_ring", _no_ring_attention),
                      (cpu_ring, "union_attention", _no_c_kernel)],
        "entries": [(runner.ModelRunner, "_compressed", _no_entries(("csa", "hca")))],
        "csa": [(runner.ModelRunner, "_compressed", _no_entries(("csa",)))],
        "hca": [(runner.ModelRunner, "_compressed", _no_entries(("hca",)))],
        "feed": [(compressor, "feed", nothing)],
        "feed-mm": [(ops, "compressor_inputs", _no_projection("cmp_wv")),
                    (ops, "indexer_inputs", _no_projection("idx_wv"))],
        "feed-pool": [(ops, "pool_entries_at", lambda w, layer, v, z, groups, m, cfg, angles=None:
                       torch.zeros(v.shape[0] // m, v.shape[1], dtype=v.dtype)),
                      (ops, "pool_index_keys", lambda w, layer, v, z, m:
                       torch.zeros(v.shape[0] // m, v.shape[1], dtype=v.dtype)),
                      (cpu_pool, "pool_into", lambda *a, **k: True)],
        "feed-ring": [(compressor, "put_at", nothing), (compressor, "take_at", _no_take)],
        "writes": [(runner, "put_at", nothing), (window_mirror, "put_at", nothing)],
        "mirror": [(window_mirror, "put_at", nothing)],
        "quantize": [(ops, "quantize_kv", _no_quantize)],
        "ffn": [(ops, "ffn", lambda w, layer, x, cfg: torch.zeros_like(x))],
        "torch-rows": [(cpu_rows, "rms_norm", nothing), (cpu_rows, "rope_", lambda *a: False)],
    }[piece]


def decoding(batches: list[int], prompt_len: int):
    """Yields (engine, b) for b in batches, largest first, every sequence decoding."""
    core = engine(max(batches), prompt_len)
    ids = [core.add_request(prompt(prompt_len, i), params(10_000)).request_id
           for i in range(max(batches))]
    while not decoding_only(core):
        core.step()
    for b in sorted(batches, reverse=True):
        for rid in ids[b:]:
            core.abort(rid)
        core.step()
        yield core, b


def cost(core, piece: str, pairs: int, steps: int, clock) -> tuple[float, float, float]:
    """(mean real step s, mean paired saving s, its standard error) over `pairs` block pairs."""
    swaps = patches(piece)
    real = [getattr(owner, name) for owner, name, _ in swaps]
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(2 * pairs):
            free = i % 2 == 1
            for (owner, name, fake), orig in zip(swaps, real, strict=True):
                setattr(owner, name, fake if free else orig)
            core.step()                          # the first step after a swap is not timed
            t0 = clock()
            for _ in range(steps):
                core.step()
            times[free].append((clock() - t0) / steps)
    finally:
        for (owner, name, _), orig in zip(swaps, real, strict=True):
            setattr(owner, name, orig)
    saved = [a - b for a, b in zip(times[False], times[True], strict=True)]
    return statistics.mean(times[False]), statistics.mean(saved), \
        statistics.stdev(saved) / len(saved) ** 0.5


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--pieces", default=",".join(PIECES))
    ap.add_argument("--pairs", type=int, default=12, help="block pairs per piece and batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    batches = sorted(int(b) for b in args.batches.split(","))
    pieces = [p for p in args.pieces.split(",") if p]
    bad = [p for p in pieces if p not in PIECES]
    if bad:
        ap.error(f"unknown pieces {bad}; choose from {', '.join(PIECES)}")
    if args.pairs < 2:
        ap.error("--pairs must be at least 2 (a piece's standard error needs two pairs)")
    res: dict[str, dict[int, tuple[float, float, float]]] = {p: {} for p in pieces}
    for core, b in decoding(batches, args.prompt):
        for p in pieces:
            res[p][b] = cost(core, p, args.pairs, args.steps, clock)
            print(f"  b{b} {p}: step {res[p][b][0] * 1e3:.1f} ms, the piece "
                  f"{res[p][b][1] * 1e3:.2f} +- {res[p][b][2] * 1e3:.2f} ms", flush=True)
    lo = batches[0]
    print(f"\nin-step cost of each piece ({args.clock} seconds, {args.threads} thread(s)); "
          f"growth = cost(b) - cost({lo})")
    heads = ["piece"] + [f"b{b} ms" for b in batches] + [f"growth b{b}" for b in batches[1:]]
    rows = [[p] + [f"{res[p][b][1] * 1e3:.2f} +- {res[p][b][2] * 1e3:.2f}" for b in batches]
            + [res[p][b][1] * 1e3 - res[p][lo][1] * 1e3 for b in batches[1:]] for p in pieces]
    rows.append(["(whole step)"] + [statistics.mean(res[p][b][0] for p in pieces) * 1e3
                                    for b in batches]
                + [statistics.mean(res[p][b][0] - res[p][lo][0] for p in pieces) * 1e3
                   for b in batches[1:]])
    print(table(heads, rows))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine_step_costs.json").write_text(json.dumps(
        {"args": vars(args), "cost_s": {p: {b: list(v) for b, v in d.items()} for p, d in res.items()}},
        indent=1))
    path = plot(OUT / "engine_step_costs.png", "decode step: in-step cost of each piece",
                "batch", "ms", {p: (batches, [max(res[p][b][1] * 1e3, 1e-3) for b in batches])
                                for p in pieces})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
