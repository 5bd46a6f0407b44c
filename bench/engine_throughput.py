"""Engine throughput: does batching pay? (tiny preset, fp32, in-process EngineCore, 1 thread)

    1. decode step time at batch 1, 8, 32, 64 (every sequence decoding, no prefill work);
    2. generated tokens/s for N = 1, 8, 32, 64 concurrent requests vs the same requests one
       after another (decode-only: steps without prefill work; end to end: everything);
    3. inter-token latency p50/p99 of 16 decoding streams alone, and while a 4K-token prompt
       is prefilled beside them.

Targets (issue 11): step(32) <= 2 x step(1); decode-only tokens/s at N = 32 >= 12 x N = 1.
Only public EngineCore calls are used, so the same script measures an older checkout, and
`--before DIR` does both in one run (DIR first, in a subprocess, then this checkout):
    python bench/engine_throughput.py --before /old/checkout
(or by hand: PYTHONPATH=/old/checkout python bench/engine_throughput.py --label before, then
 python bench/engine_throughput.py --compare bench/out/engine_throughput_before.json).

The floor: `attention floor` is what the window attention alone costs at each batch on this
machine (per layer, one fp32 matmul of every row's query with its slot's W + B ring rows and
one back, the ring path's only per-row work that grows with W), with no other model math and
no per-step overhead. It bounds from below what step(b) - step(1) can reach on a CPU.
Sequential throughput is measured on `--sequential` requests run one after another (a
request alone costs the same whatever N is) and reported for every N.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("PYTHONPATH"):        # an older checkout under test goes first
    sys.path.insert(0, os.environ["PYTHONPATH"].split(":")[0])

from bench._common import OUT, plot, table  # noqa: E402
from services.engine.config import TINY  # noqa: E402

try:
    from services.engine.config import EngineConfig
    from services.engine.core.engine import EngineCore
    from services.engine.core.sampling import SamplingParams
except ImportError:            # a checkout from before the engine layout of issue 10
    from services.engine.engine import EngineCore
    from services.engine.engine_config import EngineConfig
    from services.engine.sampling import SamplingParams

BATCHES = (1, 8, 32, 64)
# The bench machine is shared and loaded (load average >> cores), so wall time mostly
# measures the neighbours; with one torch thread, process CPU seconds are the engine's own
# cost. --clock wall switches back to wall time.
clock = time.process_time


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CHUNK: dict = {}       # {"long_prefill_chunk": n} when --long-prefill-chunk is given (newer engines)


def engine(slots: int, prompt_len: int, extra: int = 0) -> EngineCore:
    blocks = slots * ((prompt_len + 600) // 128 + 2) + extra // 128 + 8
    return EngineCore(TINY, EngineConfig(num_slots=slots, max_running=slots, num_blocks=blocks,
                                         max_batched_tokens=512, swa_policy="zero", **CHUNK))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def decoding_only(core: EngineCore) -> bool:
    return not core.scheduler.waiting and all(not s.prefilling for s in core.scheduler.running)


def step_times(prompt_len: int, steps: int) -> dict[int, float]:
    """Median decode step time at each batch size: 64 sequences, then abort down to 32, 8, 1."""
    core = engine(max(BATCHES), prompt_len)
    ids = [core.add_request(prompt(prompt_len, i), params(10_000)).request_id for i in range(max(BATCHES))]
    while not decoding_only(core):
        core.step()
    out = {}
    for b in sorted(BATCHES, reverse=True):
        for rid in ids[b:]:
            core.abort(rid)
        core.step()                                   # frees the aborted slots
        times = []
        for _ in range(steps):
            t0 = clock()
            core.step()
            times.append(clock() - t0)
        out[b] = statistics.median(times)
        print(f"  step at batch {b}: {out[b] * 1e3:.1f} ms", flush=True)
    return out


def run_requests(n: int, prompt_len: int, gen: int, seed: int) -> tuple[float, float, int]:
    """N requests at once -> (end-to-end seconds, decode-only seconds, decode-only tokens)."""
    core = engine(max(n, 1), prompt_len)
    for i in range(n):
        core.add_request(prompt(prompt_len, seed + i), params(gen))
    total = dec_s = 0.0
    dec_tokens = 0
    while core.has_work:
        only = decoding_only(core)
        t0 = clock()
        events = core.step()
        dt = clock() - t0
        total += dt
        if only:
            dec_s += dt
            dec_tokens += sum(len(e.token_ids) for e in events)
    return total, dec_s, dec_tokens


def throughput(prompt_len: int, gen: int, sequential: int) -> dict:
    seq = [run_requests(1, prompt_len, gen, 1000 + i) for i in range(sequential)]
    seq_s = statistics.mean(s[0] for s in seq)                 # one request alone, end to end
    seq_dec = sum(s[2] for s in seq) / sum(s[1] for s in seq)  # decode-only tokens/s alone
    out = {}
    for n in BATCHES:
        total, dec_s, dec_tokens = run_requests(n, prompt_len, gen, 2000)
        out[n] = {"e2e_tok_s": n * gen / total, "seq_tok_s": gen / seq_s,
                  "dec_tok_s": dec_tokens / dec_s if dec_s else 0.0, "seq_dec_tok_s": seq_dec}
        print(f"  N={n}: {out[n]['e2e_tok_s']:.1f} tok/s end to end "
              f"({out[n]['dec_tok_s']:.1f} decode-only); sequential {gen / seq_s:.1f}", flush=True)
    return out


def itl(prompt_len: int, long_len: int, steps: int) -> dict:
    """Inter-token gaps of 16 decoding streams, alone and beside a long prefill."""
    core = engine(17, prompt_len, extra=long_len)
    for i in range(16):
        core.add_request(prompt(prompt_len, 3000 + i), params(10_000))
    while not decoding_only(core):
        core.step()
    alone = []
    for _ in range(steps):
        t0 = clock()
        core.step()
        alone.append(clock() - t0)
    long_req = core.add_request(prompt(long_len, 7), params(1))
    beside = []
    while not long_req.finished:
        t0 = clock()
        core.step()
        beside.append(clock() - t0)    # every stream got one token this step

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
    out = {"alone_p50": pct(alone, 50), "alone_p99": pct(alone, 99),
           "prefill_p50": pct(beside, 50), "prefill_p99": pct(beside, 99), "prefill_steps": len(beside)}
    print("  ITL " + "  ".join(f"{k} {v * 1e3 if k != 'prefill_steps' else v:.1f}" for k, v in out.items()),
          flush=True)
    return out


def attention_floor(steps: int) -> dict[int, float]:
    """Seconds per step of the window attention's matmuls alone (see the module docstring):
    every layer's [b, H, D] x [b, D, R] and back over distinct rings (no cache reuse)."""
    cfg, ring = TINY, TINY.window + 6
    rings = [torch.randn(max(BATCHES), ring, cfg.head_dim) for _ in range(cfg.n_layers)]
    out = {}
    for b in BATCHES:
        q = torch.randn(b, cfg.n_heads, cfg.head_dim)
        p = torch.randn(b, cfg.n_heads, ring)
        times = []
        for _ in range(steps):
            t0 = clock()
            for keys in rings:
                torch.bmm(q, keys[:b].transpose(1, 2))
                torch.bmm(p, keys[:b])
            times.append(clock() - t0)
        out[b] = statistics.median(times)
    print("  attention floor " + "  ".join(f"b{b} {v * 1e3:.1f} ms" for b, v in out.items()), flush=True)
    return out


def report(res: dict, before: dict | None) -> None:
    print(f"\nclock: {res['args']['clock']} seconds (1 torch thread)")
    cols = [("before", before), ("after", res)] if before else [(res["label"], res)]
    st = lambda r, b: r["step_s"][str(b)] if str(b) in r["step_s"] else r["step_s"][b]  # noqa: E731
    tp = lambda r, b: r["tput"][str(b)] if str(b) in r["tput"] else r["tput"][b]  # noqa: E731
    rows = []
    fl = res.get("floor_s", {})
    for b in BATCHES:
        row = [b]
        for _, r in cols:
            row += [st(r, b) * 1e3, st(r, b) / st(r, 1)]
        f = fl.get(str(b), fl.get(b))
        row += [f * 1e3 if f is not None else float("nan"),
                (st(res, 1) + f) / st(res, 1) if f is not None else float("nan")]
        rows.append(row)
    print("\ndecode step time (ms); floor = window attention matmuls alone; "
          "floor x = (step(1) + floor(b)) / step(1), the best ratio this CPU allows")
    print(table(["batch"] + [f"{n} {h}" for n, _ in cols for h in ("ms", "x batch1")]
                + ["floor ms", "floor x"], rows))
    rows = []
    for n in BATCHES:
        row = [n]
        for _, r in cols:
            t = tp(r, n)
            row += [t["e2e_tok_s"], t["e2e_tok_s"] / t["seq_tok_s"], t["dec_tok_s"],
                    t["dec_tok_s"] / tp(r, 1)["dec_tok_s"]]
        rows.append(row)
    print("\ngenerated tokens/s (e2e = with prefills; vs seq = / same requests one after another)")
    print(table(["N"] + [f"{n} {h}" for n, _ in cols for h in ("e2e tok/s", "vs seq", "decode tok/s",
                                                                 "vs N=1")], rows))
    print("\ninter-token latency, 16 decoding streams (ms)")
    keys = ("alone_p50", "alone_p99", "prefill_p50", "prefill_p99")
    print(table(["run"] + list(keys), [[n] + [r["itl"][k] * 1e3 for k in keys] for n, r in cols]))
    print("\ntargets: step(32) <= 2 x step(1); decode tok/s at N=32 >= 12 x N=1")
    series = {f"{n} step time": (list(BATCHES), [st(r, b) * 1e3 for b in BATCHES]) for n, r in cols}
    series.update({f"{n} decode tok/s": (list(BATCHES), [tp(r, b)["dec_tok_s"] for b in BATCHES])
                   for n, r in cols})
    path = plot(OUT / "engine_throughput.png", "tiny, fp32, 1 thread: decode step ms / decode tok/s",
                "batch (concurrent requests)", "ms | tokens/s", series)
    print(f"plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sequential", type=int, default=2)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--compare", help="JSON of an earlier run to print side by side")
    ap.add_argument("--before", help="an older checkout: measure it first (same arguments, "
                                     "subprocess with PYTHONPATH=DIR) and print it side by side")
    ap.add_argument("--long-prefill-chunk", type=int, default=0,
                    help="cap prefill chunks (engines with issue 11's scheduler); 0: budget only")
    ap.add_argument("--itl-only", action="store_true", help="only the inter-token latency part")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    if args.long_prefill_chunk:
        CHUNK["long_prefill_chunk"] = args.long_prefill_chunk
    print(f"load average {os.getloadavg()}", flush=True)
    if args.before:
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        i = rest.index("--before")
        rest = rest[:i] + rest[i + 2:]
        print(f"== before: {args.before}", flush=True)
        subprocess.run([sys.executable, __file__, "--label", "before", *rest], check=True,
                       env={**os.environ, "PYTHONPATH": args.before}, cwd=args.before)
        # the old checkout's bench/_common.py put it under its own bench/out
        args.compare = str(Path(args.before) / "bench" / "out" / "engine_throughput_before.json")
        print("== after: this checkout", flush=True)
    if args.itl_only:
        itl(args.prompt, args.long, 20)
        return 0
    t0 = time.perf_counter()
    res = {"label": args.label, "load": os.getloadavg(), "args": vars(args)}
    res["step_s"] = step_times(args.prompt, args.steps)
    res["tput"] = throughput(args.prompt, args.gen, args.sequential)
    res["itl"] = itl(args.prompt, args.long, 20)
    res["floor_s"] = attention_floor(args.steps)
    res["wall_s"] = time.perf_counter() - t0
    res["load_end"] = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"engine_throughput_{args.label}.json").write_text(json.dumps(res, indent=1))
    before = json.loads(Path(args.compare).read_text()) if args.compare else None
    report(res, before)
    print(f"wall {res['wall_s']:.0f}s, load average {res['load']} -> {res['load_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
