"""The SWA snapshot policies over a request trace: variant 7 of bench/quality/replay_v41.py
(the shipped V4.1 model). The engine comes from the caller (`make(n_seqs, longest,
**engine_config)` and its `run`).

The trace (deterministic for --seed): sessions in groups that share a prefix (a 512 or
1024-token held-out window, standing for a shared system prompt or document), then
each session's own held-out text. Turn 1 is the prefix plus 128-512 tokens of its own;
each follow-up appends 200-500 tokens (the first 64 of which are the previous turn's
answer, teacher-forced to the true text). Sessions start at random waves and wait 1-3
waves between turns, sometimes 8 (a user back from a break: by then other sessions'
snapshots and blocks may have pushed theirs out of the store and the pool). Requests of
one wave arrive together and run concurrently; the next wave arrives when they are done.

Every policy engine replays the same trace with one salt (sessions of a group share their
prefix's blocks), a snapshot store of --trace-snapshots snapshots and a block pool of the
running requests' need plus --trace-cache-blocks cached blocks. Per request: how it was
admitted (snapshot hit, bounded replay, miss), prompt tokens computed (L - resume
position), TTFT (wave arrival to the row that gives the first token, in this process,
under the wave's batching) and KL / perplexity change of the 64-token answer against a
cold `compact` computation of the same prompt (computed once for all policies).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from bench.quality.forcing import aggregate, forced, prompt_stats
from kvmesh.training import data

BLOCK = 128
CONT = 64                       # tokens of continuation scored after each prompt

PREFIXES = (512, 1024)
SESSIONS_PER_PREFIX = 4
GAPS = (1, 1, 1, 2, 3, 8)        # waves between a session's turns (8: back from a break)


@dataclass
class TraceReq:
    name: str
    session: int
    turn: int
    wave: int
    prompt: list[int]
    cont: list[int]


def add_trace_args(p, variant: int) -> None:
    """The trace's flags, on either bench's parser (`variant`: its number there)."""
    p.add_argument("--policies", default="full,periodic:4,zero",
                   help=f"variant {variant}'s --swa-policy values")
    p.add_argument("--trace-sessions", type=int, default=12,
                   help=f"variant {variant}: sessions in the trace")
    p.add_argument("--trace-turns", type=int, default=5,
                   help=f"variant {variant}: most turns of a session")
    p.add_argument("--trace-snapshots", type=int, default=12,
                   help=f"variant {variant}: snapshot store budget, in snapshots")
    p.add_argument("--trace-cache-blocks", type=int, default=96,
                   help=f"variant {variant}: cached blocks the pool keeps beyond the running "
                   "requests'")


def make_trace(a, val) -> list[TraceReq]:
    rng = random.Random(a.seed + 4)
    n = a.trace_sessions
    groups = max(1, n // SESSIONS_PER_PREFIX)
    own_len = 512 + 500 * (a.trace_turns - 1) + CONT
    texts = windows(val, groups + n, max(PREFIXES) + own_len)
    prefixes = [texts[g][: rng.choice(PREFIXES)] for g in range(groups)]
    reqs = []
    for s in range(n):
        own = texts[groups + s]
        prefix = prefixes[s % groups]
        wave, used = rng.randint(0, max(1, n // 4)), rng.randint(128, 512)
        for t in range(rng.randint(1, a.trace_turns)):
            if t:
                wave, used = wave + rng.choice(GAPS), used + rng.randint(200, 500)
            reqs.append(TraceReq(f"s{s}t{t}", s, t, wave, prefix + own[:used], own[used: used + CONT]))
    return sorted(reqs, key=lambda r: (r.wave, r.session))


def exact_answers(a, make, run, reqs: list[TraceReq]) -> dict:
    """Cold compact, one salt per request, in batches of --group."""
    longest = max(len(r.prompt) for r in reqs) + CONT
    eng = make(a.group, longest, truncation="compact", keep_tokens=a.keep)
    out = {}
    for k in range(0, len(reqs), a.group):
        out.update(run(eng, [forced(r.name, r.prompt, r.cont, f"cold:{r.name}") for r in reqs[k: k + a.group]]))
    return out


def replay_trace(a, make, run, reqs: list[TraceReq], policy: str, exact: dict,
                 snap_bytes: int) -> dict:
    """The trace on one engine with --swa-policy `policy`, a store of --trace-snapshots
    snapshots of `snap_bytes` each and a pool of the running requests' need plus
    --trace-cache-blocks."""
    waves = sorted({r.wave for r in reqs})
    per_wave = max(sum(r.wave == v for r in reqs) for v in waves)
    longest = max(len(r.prompt) for r in reqs) + CONT
    blocks = per_wave * (longest // BLOCK + 2) + a.trace_cache_blocks
    eng = make(per_wave, longest, truncation="compact", keep_tokens=a.keep, swa_policy=policy,
               num_blocks=blocks, snapshot_bytes=a.trace_snapshots * snap_bytes)
    recs, kinds = [], {"snapshot": [], "replay": [], "miss": []}
    for v in waves:
        got = run(eng, [forced(r.name, r.prompt, r.cont, "trace") for r in reqs if r.wave == v])
        for r in (r for r in reqs if r.wave == v):
            o = got[r.name]
            kind = "miss" if not o.cached else "snapshot" if o.snapshot_hit else "replay"
            rec = {**prompt_stats(exact[r.name].logits, o.logits, r.cont), "kind": kind,
                   "computed": len(r.prompt) - o.start, "prompt": len(r.prompt), "ttft_s": o.ttft_s,
                   "replayed": o.replayed, "cached": o.cached, "turn": r.turn,
                   "preemptions": o.preemptions}
            recs.append(rec)
            kinds[kind].append(rec)
    n = len(recs)
    out = aggregate(recs)
    turns = sorted({r["turn"] for r in recs})
    out["kl_by_turn"] = [aggregate([r for r in recs if r["turn"] == t])["kl_mean"] for t in turns]
    out.update({f"{k}_pct": 100 * len(v) / n for k, v in kinds.items()})
    out.update({f"kl_{k}": aggregate(v)["kl_mean"] for k, v in kinds.items() if v})
    out.update(requests=n, computed_mean=sum(r["computed"] for r in recs) / n,
               prompt_mean=sum(r["prompt"] for r in recs) / n,
               ttft_ms_mean=1e3 * sum(r["ttft_s"] for r in recs) / n,
               ttft_ms_p90=1e3 * sorted(r["ttft_s"] for r in recs)[int(0.9 * (n - 1))],
               snapshot_stores=eng.counters["snapshot_stores"],
               preemptions=sum(r["preemptions"] for r in recs))
    return out


def trace_variant(a, make, run, val, snap_bytes: int) -> dict:
    """Every --policies value over one trace of `val`'s held-out text; `make` and `run` are
    the engine's (see the module docstring), `snap_bytes` one snapshot's size."""
    reqs = make_trace(a, val)
    t0 = time.perf_counter()
    exact = exact_answers(a, make, run, reqs)
    print(f"trace: {len(reqs)} requests, {len({r.wave for r in reqs})} waves; exact answers in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for policy in a.policies.split(","):
        t0 = time.perf_counter()
        out[policy] = replay_trace(a, make, run, reqs, policy, exact, snap_bytes)
        print(f"trace {policy}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def windows(val, n: int, length: int) -> list[list[int]]:
    """n evenly spaced held-out windows of `length` tokens."""
    return [r[:length].tolist() for r in data.eval_windows(val, n, length)]
