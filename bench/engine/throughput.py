"""Engine throughput: does batching pay? (tiny preset, fp32, in-process EngineCore, 1 thread)

    1. decode step time at batch 1, 8, 32, 64 (every sequence decoding, no prefill work);
    2. generated tokens/s for N = 1, 8, 32, 64 concurrent requests vs the same requests one
       after another (decode-only: steps without prefill work; end to end: everything);
    3. inter-token latency p50/p99 of 16 decoding streams alone, and while a 4K-token prompt
       is prefilled beside them (--itl-rounds rounds, each a new prompt; the percentiles are
       over every round's steps, their counts and the max printed with them). --itl-ratio X
       runs the engine's latency-sized prefill (core/step_costs.py) instead of, or under,
       --long-prefill-chunk.

Targets (issue 11): step(32) <= 2 x step(1); decode-only tokens/s at N = 32 >= 12 x N = 1.
To set two trees side by side, run it in a worktree of the older one with `--label before`,
then here with `--compare` naming the JSON that run wrote:
    git worktree add /tmp/before <ref> && (cd /tmp/before && python -m bench.engine.throughput --label before)
    python -m bench.engine.throughput --compare /tmp/before/bench/out/engine_throughput_before.json

The floor (`floors`): the work that grows with the batch, timed alone at each batch: every
weight matmul of a decode step, the window attention of every layer through the engine's
own kernel (the only per-row work that reads W keys), and one plain read of those rings
(the memory traffic fp32 rings cost whatever the kernel). rest = step - both: per-step overhead (Python, index
tensors, small ops, sampling, bookkeeping) plus the smaller per-row pieces (gathers of
compressed entries, indexer, compressor feeding, MXFP8). best x = (step(1) + what the
matmuls and attention add from batch 1 to b) / step(1): the ratio if nothing else grew.
The floors are timed alone, with their data hot; inside a step at batch 32 the rings and
weights come from memory (they do not stay in cache between steps), so `rest` also holds
the attention's and the gathers' cold-read excess.
End to end is bounded by the prefills (their compute is linear in tokens on a CPU): the
table prints the share of the N-request run spent in steps with prefill work, and the e2e
speedup that would leave if every decode-only step were free.
Sequential throughput is one request alone (N requests one after another take N times as
long). The machine's speed drifts by up to 2x over minutes, so each N runs `--rounds` rounds
of (one request alone, then the N requests at once), back to back: each round gives its own
e2e-vs-sequential and decode-only-vs-alone ratios, and the tables print the rounds' medians
with their range (the rates are the rounds' medians too).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import OUT, parser
from bench.engine.throughput_report import report
from kernels.cpu_gemm import pack_weights
from kernels.mxfp8 import dequantize, quantize
from kernels.ragged import RingKeys, SlotRows, ragged_union_attention
from services.engine.config import TINY, EngineConfig
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model import ops
from services.engine.model.weights import shapes

BATCHES = (1, 8, 32, 64)
PREFILL_ROWS = 512     # a prefill step's rows at the default token budget
# Process CPU seconds, with one torch thread: the engine's own cost, whatever else the
# machine runs. --clock wall switches to wall time.
clock = time.process_time


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CHUNK: dict = {}       # long_prefill_chunk / itl_ratio when given


def engine(slots: int, prompt_len: int, extra: int = 0, budget: int = 512,
           grow: int = 600) -> EngineCore:
    """Blocks for every slot's prompt and `grow` generated tokens, plus one `extra` prompt."""
    blocks = slots * ((prompt_len + grow) // 128 + 2) + extra // 128 + 8
    kw = dict(num_slots=slots, max_running=slots, num_blocks=blocks, max_batched_tokens=budget,
              swa_policy="zero", **CHUNK)
    return EngineCore(TINY, EngineConfig(**kw))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def decoding_only(core: EngineCore) -> bool:
    return not core.scheduler.waiting and all(not s.prefilling for s in core.scheduler.running)


def shrinking_batches(prompt_len: int):
    """Yields (engine, b) for b in BATCHES, largest first: max(BATCHES) sequences decoding,
    then aborted down to each smaller batch."""
    core = engine(max(BATCHES), prompt_len)
    ids = [core.add_request(prompt(prompt_len, i), params(10_000)).request_id for i in range(max(BATCHES))]
    while not decoding_only(core):
        core.step()
    for b in sorted(BATCHES, reverse=True):
        for rid in ids[b:]:
            core.abort(rid)
        core.step()                                   # frees the aborted slots
        yield core, b


def step_times(prompt_len: int, steps: int) -> dict[int, float]:
    """Median decode step time at each batch size: 64 sequences, then abort down to 32, 8, 1."""
    out = {}
    for core, b in shrinking_batches(prompt_len):
        times = []
        for _ in range(steps):
            t0 = clock()
            core.step()
            times.append(clock() - t0)
        out[b] = statistics.median(times)
        print(f"  step at batch {b}: {out[b] * 1e3:.1f} ms", flush=True)
    return out


def run_requests(n: int, prompt_len: int, gen: int, seed: int,
                 budget: int = 512) -> tuple[float, float, int]:
    """N requests at once -> (end-to-end seconds, decode-only seconds, decode-only tokens);
    end to end minus decode-only is the steps with prefill work in them."""
    core = engine(max(n, 1), prompt_len, budget=budget)
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


def throughput(prompt_len: int, gen: int, rounds: int) -> dict:
    """For each N, `rounds` rounds of one request alone and then N requests at once, back to
    back: each round's ratios (e2e vs seq, decode-only vs the request alone) compare runs
    seconds apart, so the machine's drift hits both sides alike. Ratios and rates are the
    rounds' medians."""
    out = {}
    for n in BATCHES:
        rs = []
        for r in range(rounds):
            alone = run_requests(1, prompt_len, gen, 1000 + r)
            total, dec_s, dec_tokens = run_requests(n, prompt_len, gen, 2000 + 100 * r)
            rs.append({"e2e_tok_s": n * gen / total, "seq_tok_s": gen / alone[0],
                       "dec_tok_s": dec_tokens / dec_s if dec_s else 0.0,
                       "seq_dec_tok_s": alone[2] / alone[1] if alone[1] else 0.0,
                       "prefill_share": 1.0 - dec_s / total,
                       "seq_prefill_share": 1.0 - alone[1] / alone[0]})
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        e2e = sorted(x["e2e_tok_s"] / x["seq_tok_s"] for x in rs)
        dec = sorted(x["dec_tok_s"] / x["seq_dec_tok_s"] for x in rs if x["seq_dec_tok_s"])
        out[n] = {**med, "e2e_vs_seq": statistics.median(e2e), "e2e_vs_seq_range": [e2e[0], e2e[-1]],
                  "dec_vs_1": statistics.median(dec) if dec else 0.0,
                  "dec_vs_1_range": [dec[0], dec[-1]] if dec else [0.0, 0.0], "rounds": rounds}
        print(f"  N={n}: {med['e2e_tok_s']:.1f} tok/s end to end ({med['dec_tok_s']:.1f} decode-only); "
              f"alone {med['seq_tok_s']:.1f}; rounds' e2e vs seq {', '.join(f'{x:.2f}' for x in e2e)}",
              flush=True)
    return out


def budgets(prompt_len: int, gen: int, n: int, values: list[int]) -> dict[int, dict]:
    """The scheduler's mix at N concurrent requests: end to end under each token budget per
    step (max_batched_tokens; decodes first, then prefill chunks)."""
    out = {}
    for b in values:
        total, dec_s, _ = run_requests(n, prompt_len, gen, 2000, budget=b)
        out[b] = {"e2e_tok_s": n * gen / total, "prefill_share": 1.0 - dec_s / total}
        print(f"  budget {b}: N={n} {out[b]['e2e_tok_s']:.1f} tok/s end to end", flush=True)
    return out


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile: of 64 gaps p99 is the second largest, of 192 the third."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def itl(prompt_len: int, long_len: int, steps: int, repeat: int = 1) -> dict:
    """Inter-token gaps of 16 decoding streams, alone and beside a long prefill: `repeat`
    rounds of `steps` decode-only steps then one long prompt (a new one each round, so no
    prefix hit) prefilled beside the streams. Every step gives each stream one token, so a
    step's time is one gap of every stream; the rounds alternate, so a drifting machine load
    hits both sides alike, and the p99 is taken over every round's steps (their counts are
    reported: p99 of 64 gaps is the second largest, of 192 the third) with the max beside it."""
    # The streams decode through every round: each round's steps, plus one step per chunk of
    # the long prompt (at least MIN_PREFILL = 16 tokens a chunk). Sized for fewer, later
    # rounds ran out of blocks and the long prompt waited on them (5 rounds: 144 s a prompt).
    core = engine(17, prompt_len, extra=long_len,
                  grow=max(600, repeat * (steps + long_len // 16) + 128))
    for i in range(16):
        core.add_request(prompt(prompt_len, 3000 + i), params(10_000))
    while not decoding_only(core):
        core.step()
    alone, beside = [], []
    for r in range(repeat):
        for _ in range(steps):
            t0 = clock()
            core.step()
            alone.append(clock() - t0)
        long_req = core.add_request(prompt(long_len, 7 + r), params(1))
        while not long_req.finished:
            t0 = clock()
            core.step()
            beside.append(clock() - t0)    # every stream got one token this step
    out = {"alone_p50": pct(alone, 50), "alone_p99": pct(alone, 99), "alone_max": max(alone),
           "prefill_p50": pct(beside, 50), "prefill_p90": pct(beside, 90),
           "prefill_p99": pct(beside, 99), "prefill_max": max(beside),
           "prompt_s": sum(beside) / repeat,     # the long prompt's time to its first token
           "alone_steps": len(alone), "prefill_steps": len(beside), "rounds": repeat}
    print("  ITL " + "  ".join(f"{k} {v * 1e3:.1f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in out.items()), flush=True)
    return out


MATMULS = ("wq", "wkv", "wo", "w1", "w3", "w2", "cmp_wv", "cmp_wz", "idx_wv", "idx_wz",
           "idx_wq", "idx_ww")


def _median_s(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def floors(steps: int) -> dict[str, dict[int, float]]:
    """Seconds per decode step at each batch of the work that grows with the batch, each
    alone: `matmul`, every weight matmul a decode step does (b rows through each layer's
    projections, FFN, compressor and indexer inputs, and the LM head); `attention`, the
    window attention of every layer through the engine's own kernel
    (kernels/ragged.ragged_union_attention with b decode rows on their slots' rings, as the
    runner calls it); `read`, reading those rings once (a sum): the memory traffic the
    attention cannot avoid with fp32 rings. What a step costs beyond matmul and attention
    (Python, index tensors, small ops, gathers, sampling, bookkeeping) is the `rest`."""
    cfg, ring = TINY, TINY.window + 6
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(*shape, generator=g) for name, shape in shapes(cfg).items()
            if name.rsplit(".", 1)[-1] in MATMULS or name == "lm_head"]
    # packed into column panels, as the runner packs the model's: as stored, the products
    # took 5.5-6.1 ms at batch 1 (packed 1.7-2.0) and 8.5-14 ms at batch 32 (packed 2.8)
    pack_weights(mats)
    rings = [torch.randn(max(BATCHES), ring, cfg.head_dim) for _ in range(cfg.n_layers)]
    # the rings' MXFP8 bytes too, as the engine passes them (the compiled CPU kernel reads
    # those; the torch path the fp32 values); the values are then exactly the bytes' values
    codes = [quantize(r) for r in rings]
    rings = [dequantize(c) for c in codes]
    out: dict[str, dict] = {"matmul": {}, "attention": {}, "read": {}}
    for b in BATCHES:
        xs = {m.shape[0]: torch.randn(b, m.shape[0], generator=g) for m in mats}
        q = torch.randn(b, cfg.n_heads, cfg.head_dim)
        out["matmul"][b] = _median_s(lambda xs=xs: _matmuls(xs, mats), steps)
        out["attention"][b] = _median_s(_ring_attention(q, rings, codes), steps)
        out["read"][b] = _median_s(lambda b=b: [r[:b].sum() for r in rings], steps)
    # The same matmuls for a prefill step's rows, fp32 (what the engine serves) and bf16 (what
    # this design change would serve: CPUs with AMX/AVX512-BF16 run it several times faster;
    # the MXFP8 ring values are exact in bf16, the activations would not be).
    xs = {m.shape[0]: torch.randn(PREFILL_ROWS, m.shape[0], generator=g) for m in mats}
    out["prefill_matmul"] = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        xd, md = {k: x.to(dt) for k, x in xs.items()}, [m.to(dt) for m in mats]
        out["prefill_matmul"][name] = _median_s(lambda xd=xd, md=md: _matmuls(xd, md), steps)
    print("  floor " + "  ".join(f"b{b} matmul {out['matmul'][b] * 1e3:.1f} ms attention "
                                 f"{out['attention'][b] * 1e3:.1f} ms read {out['read'][b] * 1e3:.1f} ms"
                                 for b in BATCHES), flush=True)
    return out


def _matmuls(xs: dict, mats: list) -> None:
    """Through the engine's own product (ops.mm: the compiled CPU kernel where it is built)."""
    for m in mats:
        ops.mm(xs[m.shape[0]], m)


def _ring_attention(q, rings: list, codes: list):
    """Every layer's window attention for q's decode rows, one row per slot, all 128 window
    keys of the ring visible, through the engine's ragged op (whatever kernel it picks)."""
    b, h, d = q.shape
    rows = SlotRows.build(list(range(b)))
    ok = torch.ones(b, rings[0].shape[1], dtype=torch.bool)
    ok[:, : rings[0].shape[1] - TINY.window] = False
    sink = torch.zeros(h)
    return lambda: [ragged_union_attention(q, [RingKeys(r, rows, ok, c)], sink, d ** -0.5)
                    for r, c in zip(rings, codes, strict=True)]


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64,
                    help="tokens per request (64: the workload issue 11 states, 256-token prompts)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of one request alone, then N at once, for each N (ratios per "
                         "round, medians printed)")
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--compare", help="JSON of an earlier run to print side by side")
    ap.add_argument("--long-prefill-chunk", type=int, default=0,
                    help="cap prefill chunks; 0: budget only")
    ap.add_argument("--itl-ratio", type=float, default=0.0,
                    help="size prefill work beside decodes to this x a decode-only step "
                         "(core/step_costs.py); 0: off")
    ap.add_argument("--itl-rounds", type=int, default=3,
                    help="rounds of decode-only steps + one long prompt beside the streams (the "
                         "ITL percentiles are over all rounds)")
    ap.add_argument("--itl-steps", type=int, default=40, help="decode-only steps per ITL round")
    ap.add_argument("--itl-only", action="store_true", help="only the inter-token latency part")
    ap.add_argument("--budgets", default="",
                    help="comma-separated max_batched_tokens values: N = 32 end to end under each")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the machine's cores: what a deployment uses); more than "
                         "one needs --clock wall and a quiet machine (CPU seconds add the threads up)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.threads > 1 and args.clock != "wall":
        ap.error("--threads > 1 needs --clock wall (CPU seconds add the threads up)")
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    if args.long_prefill_chunk:
        CHUNK["long_prefill_chunk"] = args.long_prefill_chunk
    if args.itl_ratio:
        CHUNK["itl_ratio"] = args.itl_ratio
    print(f"system load {os.getloadavg()}", flush=True)
    if args.itl_only:
        itl(args.prompt, args.long, args.itl_steps, args.itl_rounds)
        return 0
    t0 = time.perf_counter()
    res = {"label": args.label, "load": os.getloadavg(), "args": vars(args)}
    res["step_s"] = step_times(args.prompt, args.steps)
    res["tput"] = throughput(args.prompt, args.gen, args.rounds)
    res["itl"] = itl(args.prompt, args.long, args.itl_steps, args.itl_rounds)
    if args.budgets:
        res["budgets"] = budgets(args.prompt, args.gen, 32, [int(b) for b in args.budgets.split(",")])
    res["floors"] = floors(max(args.steps, 9))
    res["wall_s"] = time.perf_counter() - t0
    res["load_end"] = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"engine_throughput_{args.label}.json").write_text(json.dumps(res, indent=1))
    before = json.loads(Path(args.compare).read_text()) if args.compare else None
    report(res, before, BATCHES, PREFILL_ROWS)
    print(f"wall {res['wall_s']:.0f}s, system load {res['load']} -> {res['load_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
