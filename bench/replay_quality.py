"""What bounded replay, YOCO truncation and MXFP8 cost in quality, on the trained checkpoint.

Held-out stdlib files (never trained on), each prompt followed by its true 64-token
continuation. Every variant runs in a real in-process engine (float32, MXFP8 SWA KV,
as served) against the exact path for the same prompts:

    1 truncation  compact cold            vs  off cold           (what YOCO truncation costs)
    2 snapshot    compact, snapshot hit   vs  compact cold       (must be exact)
    3 replay      compact, bounded replay vs  compact cold       (what one replay costs)
    4 policies    chained sessions under --swa-policy full | periodic:N | zero: hit rate,
                  replayed tokens and quality (a realistic mix of hits and misses)
    5 chains      sessions of 1..T turns, each appending 200-500 tokens and hitting the
                  previous turn's blocks through replay (policy zero); blocks completed
                  after a replay shared (`--replay-blocks share`) or isolated (`isolate`)
    6 mxfp8       MXFP8 SWA KV vs unquantized SWA KV (the training forward, which can do both)

Metrics: mean per-token KL(exact || variant) over the teacher-forced continuation,
relative perplexity change on it, greedy agreement (prompts whose 64 greedy tokens are
all identical; mean position of the first difference).

Targets (docs/design.md §6, §14; issue 13): snapshot hit identical to cold; one bounded
replay <= 1 % perplexity increase and >= 90 % of prompts with 64 identical greedy tokens;
8 chained replays <= 2 % perplexity increase under the chosen lineage policy.

Usage: python bench/replay_quality.py [--prompts 32] [--lengths 1024,4096] [--sessions 8]
       [--turns 8] [--variants 1,2,3,4,5,6] [--checkpoint PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, plot, table  # noqa: E402
from bench._replay_engine import compare, make_engine, run_pairs, warm  # noqa: E402
from services.engine.build import DEFAULT_CHECKPOINTS  # noqa: E402
from services.engine.config import preset  # noqa: E402
from services.engine.model import weights as weights_mod  # noqa: E402
from services.engine.train import data  # noqa: E402
from services.engine.train.model import forward  # noqa: E402

CONT = 64


def windows(val, n: int, length: int) -> list[list[int]]:
    """n evenly spaced held-out windows of `length` tokens."""
    return [r[:length].tolist() for r in data.eval_windows(val, n, length)]


def single_variants(a, cfg, w, val, wanted) -> dict:
    """Variants 1-3 at each prompt length."""
    res = {}
    for length in a.lengths:
        t0 = time.perf_counter()
        res.update(one_length(a, cfg, w, val, wanted, length))
        print(f"L={length}: {a.prompts} prompts, variants 1-3 in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return res


def one_length(a, cfg, w, val, wanted, length: int) -> dict:
    rows = windows(val, a.prompts, length + CONT)
    prompts = {f"p{i}": r[:length] for i, r in enumerate(rows)}
    conts = {f"p{i}": r[length:] for i, r in enumerate(rows)}
    n, keep = len(rows), a.keep
    l1 = (length - keep) // cfg.block_size * cfg.block_size

    def cold(**ecfg):
        eng = make_engine(cfg, w, n, length + CONT, **ecfg)
        return run_pairs(eng, [(k, p, conts[k], f"cold:{k}") for k, p in prompts.items()])

    def hit(policy):
        """A warm-up of L1 + 1 tokens caches the blocks up to L1 (and, under `full`, the
        window at L1); the measured request then hits them."""
        eng = make_engine(cfg, w, n, length + CONT, truncation="compact", keep_tokens=keep,
                          swa_policy=policy)
        warm(eng, [(k, p[: l1 + 1], f"s:{k}") for k, p in prompts.items()])
        return run_pairs(eng, [(k, p, conts[k], f"s:{k}") for k, p in prompts.items()])

    res = {}
    compact = cold(truncation="compact", keep_tokens=keep)
    if 1 in wanted:
        res[f"1 truncation compact vs off, L={length}"] = compare(cold(truncation="off"), compact, conts)
    if 2 in wanted:
        res[f"2 snapshot hit vs cold, L={length}"] = compare(compact, hit("full"), conts)
    if 3 in wanted:
        res[f"3 bounded replay vs cold, L={length}"] = compare(compact, hit("zero"), conts)
    return res


def session_texts(a, val) -> tuple[list[list[int]], list[list[int]]]:
    """Per session: the text and the prompt length of each turn."""
    rng = random.Random(a.seed)
    longest = a.chain_start + 500 * (a.turns - 1) + CONT
    texts = windows(val, a.sessions, longest)
    lens = []
    for _ in texts:
        ls = [a.chain_start]
        for _ in range(a.turns - 1):
            ls.append(ls[-1] + rng.randint(200, 500))
        lens.append(ls)
    return texts, lens


def chain_runs(a, cfg, w, val, configs: list[tuple[str, str]]) -> dict:
    """Variants 4-5: every session's turns on one engine per (policy, replay-blocks) config,
    each turn against a cold compact computation of the same prompt."""
    texts, lens = session_texts(a, val)
    longest = max(ls[-1] for ls in lens) + CONT
    n = len(texts)

    def items(t, salt):
        return [(f"s{i}", texts[i][: lens[i][t]], texts[i][lens[i][t]: lens[i][t] + CONT], salt(i, t))
                for i in range(n)]

    conts = [{f"s{i}": texts[i][lens[i][t]: lens[i][t] + CONT] for i in range(n)} for t in range(a.turns)]
    t0 = time.perf_counter()
    exact = []
    eng = make_engine(cfg, w, n, longest, truncation="compact", keep_tokens=a.keep)
    for t in range(a.turns):
        exact.append(run_pairs(eng, items(t, lambda i, t: f"cold:{i}:{t}")))
    print(f"chains: exact turns in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for policy, blocks in configs:
        t0 = time.perf_counter()
        extra = {"replay_blocks": blocks} if blocks != "share" else {}
        eng = make_engine(cfg, w, n, longest, truncation="compact", keep_tokens=a.keep,
                          swa_policy=policy, **extra)
        per_turn = []
        for t in range(a.turns):
            got = run_pairs(eng, items(t, lambda i, t: f"sess:{i}"))
            per_turn.append(compare(exact[t], got, conts[t]))
        out[f"{policy}/{blocks}"] = per_turn
        print(f"chains {policy}/{blocks}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


@torch.no_grad()
def mxfp8_variant(a, cfg, w, val) -> dict:
    """Variant 6 with the training forward (the reference's math; quantize on or off)."""
    length = a.lengths[0]
    rows = windows(val, a.mxfp8_prompts, length + CONT)
    kls, nll = [], {False: [], True: []}
    same, first = 0, []
    for r in rows:
        x = torch.tensor(r)
        lp = {}
        for q in (False, True):
            logits, _ = forward(w, cfg, x[None, :-1], chunk=cfg.window, quantize=q)
            lp[q] = torch.log_softmax(logits[0, length - 1:].double(), -1)
            nll[q].append(-lp[q].gather(1, x[length:].view(-1, 1))[:, 0])
        kls.append((lp[False].exp() * (lp[False] - lp[True])).sum(-1))
        greedy = {}
        for q in (False, True):
            seq = x[:length].tolist()
            for _ in range(a.mxfp8_greedy):
                logits, _ = forward(w, cfg, torch.tensor(seq)[None], chunk=cfg.window, quantize=q)
                seq.append(int(logits[0, -1].argmax()))
            greedy[q] = seq[length:]
        diff = [i for i, (u, v) in enumerate(zip(greedy[False], greedy[True], strict=True)) if u != v]
        same += not diff
        first.append(diff[0] if diff else a.mxfp8_greedy)
    kl, ne, nv = torch.cat(kls), torch.cat(nll[False]), torch.cat(nll[True])
    return {"prompts": len(rows), "tokens": int(kl.numel()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "nll_exact": float(ne.mean()), "nll_variant": float(nv.mean()),
            "ppl_change_pct": 100 * (math.exp(float(nv.mean() - ne.mean())) - 1),
            "greedy_identical_pct": 100 * same / len(rows),
            "first_divergence_mean": sum(first) / len(rows), "greedy_tokens": a.mxfp8_greedy}


def report(results: dict, chains: dict, a) -> None:
    head = ["variant", "prompts", "KL mean", "KL max", "ppl change %", "greedy identical %",
            "first diff", "replayed", "snap hit %"]
    rows = [[k, r["prompts"], f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}", f"{r['ppl_change_pct']:+.3f}",
             f"{r['greedy_identical_pct']:.1f}", f"{r['first_divergence_mean']:.1f}",
             f"{r.get('replayed_tokens_mean', 0):.0f}", f"{r.get('snapshot_hit_pct', 0):.0f}"]
            for k, r in results.items()]
    print(table(head, rows))
    if not chains:
        return
    print(f"\nchained sessions ({a.sessions} sessions, prompt {a.chain_start} tokens + 200-500 per turn),"
          " per turn: KL mean / ppl change % / greedy identical %")
    turns = list(range(1, a.turns + 1))
    print(table(["config"] + [f"turn {t}" for t in turns],
                [[k] + [f"{r['kl_mean']:.1e} / {r['ppl_change_pct']:+.2f} / {r['greedy_identical_pct']:.0f}"
                        for r in per] for k, per in chains.items()]))
    print(table(["config", "snapshot hit %", "replayed tokens / turn", "cached tokens / turn",
                 "KL mean (turns 2..)",
                 "ppl change % (turns 2..)"],
                [[k, f"{sum(r['snapshot_hit_pct'] for r in per[1:]) / max(1, len(per) - 1):.0f}",
                  f"{sum(r['replayed_tokens_mean'] for r in per[1:]) / max(1, len(per) - 1):.0f}",
                  f"{sum(r['cached_tokens_mean'] for r in per[1:]) / max(1, len(per) - 1):.0f}",
                  f"{sum(r['kl_mean'] for r in per[1:]) / max(1, len(per) - 1):.2e}",
                  f"{sum(r['ppl_change_pct'] for r in per[1:]) / max(1, len(per) - 1):+.3f}"]
                 for k, per in chains.items()]))
    path = plot(OUT / "replay_quality_chain.png", "KL(exact || chained replay) per turn",
                "turn (replays so far = turn - 1)", "mean per-token KL (nats)",
                {k: (turns, [max(r["kl_mean"], 1e-9) for r in per]) for k, per in chains.items()},
                logx=False, logy=True)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINTS["tiny"]))
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts per length (variants 1-3)")
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--keep", type=int, default=134, help="YOCO KEEP (>= W + B = 134)")
    p.add_argument("--sessions", type=int, default=8, help="chained sessions (variants 4-5)")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--chain-start", type=int, default=1024, help="first turn's prompt length")
    p.add_argument("--policies", default="full,periodic:4,zero", help="variant 4's --swa-policy values")
    p.add_argument("--mxfp8-prompts", type=int, default=8, help="prompts of variant 6")
    p.add_argument("--mxfp8-greedy", type=int, default=CONT, help="greedy tokens of variant 6")
    p.add_argument("--variants", default="1,2,3,4,5,6")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT / "replay_quality.json"))
    a = p.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    wanted = {int(x) for x in a.variants.split(",")}
    torch.set_num_threads(a.threads)
    cfg = preset("tiny")
    w = weights_mod.load(a.checkpoint, cfg)
    val = data.load_corpus().val
    t0 = time.perf_counter()
    results = single_variants(a, cfg, w, val, wanted) if wanted & {1, 2, 3} else {}
    configs = []
    if 4 in wanted:
        configs += [(pol, "share") for pol in a.policies.split(",") if pol != "zero"]
    if wanted & {4, 5}:
        configs.append(("zero", "share"))
    if 5 in wanted:
        configs.append(("zero", "isolate"))
    chains = chain_runs(a, cfg, w, val, configs) if configs else {}
    if 6 in wanted:
        results[f"6 MXFP8 vs unquantized SWA KV, L={a.lengths[0]}"] = mxfp8_variant(a, cfg, w, val)
    report(results, chains, a)
    OUT.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": {k: v for k, v in vars(a).items()}, "single": results,
                                       "chains": chains, "seconds": time.perf_counter() - t0},
                                      indent=1) + "\n")
    print(f"results: {a.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
