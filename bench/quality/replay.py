"""What bounded replay, YOCO truncation and MXFP8 cost in quality, on the trained checkpoint.

Held-out stdlib files (never trained on), each prompt followed by its true 64-token
continuation. Every variant runs in a real in-process engine (float32, MXFP8 SWA KV,
as served) against the exact path for the same prompts:

    1 truncation  compact cold            vs  off cold           (what YOCO truncation costs)
    2 snapshot    compact, snapshot hit   vs  compact cold       (must be exact)
    3 replay      compact, bounded replay vs  compact cold       (what one replay costs)
    4 policies    a request trace (sessions over shared prefixes, multi-turn follow-ups,
                  think-time gaps that let snapshots and blocks be evicted) under
                  --swa-policy full | periodic:N | zero: hit rate, cost, quality (_replay_trace.py)
    5 chains      sessions of 1..T turns, each appending 200-500 tokens and hitting the
                  previous turn's blocks through replay (policy zero); blocks completed
                  after a replay shared (`--replay-blocks share`) or isolated (`isolate`)
    6 mxfp8       MXFP8 SWA KV vs unquantized SWA KV (the training forward, which can do both)

Metrics: mean per-token KL(exact || variant) over the teacher-forced continuation,
relative perplexity change on it, greedy agreement (prompts whose 64 greedy tokens are
all identical; mean position of the first difference). How it stays cheap
(bench/quality/forcing.py): the continuation is scored from one prefill of prompt +
continuation, not 64 decode steps; only the exact path decodes free-running, a variant's
agreement is read from one forced pass over the exact path's greedy tokens; the cold
`compact` run is the reference of variants 2 and 3; one engine per configuration takes
the prompts in groups of --group, all of a group's requests in the same steps.

Variants 1-3 keep per-prompt results in bench/out/replay_quality_L{L}_N{N}.jsonl and
resume from it (--fresh starts over; --merge-only reports what is there).

Targets (docs/design.md §6, §14; issue 13): snapshot hit identical to cold; one bounded
replay <= 1 % perplexity increase and >= 90 % of prompts with 64 identical greedy tokens;
8 chained replays <= 2 % perplexity increase under the chosen lineage policy.

Usage: python -m bench.quality.replay [--prompts 200] [--lengths 1024,4096] [--group 2]
       [--variants 1,2,3,4,5,6] [--sessions 8] [--turns 8] [--checkpoint PATH]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.common import OUT, parser
from bench.quality.forcing import (
    CHUNK,
    Req,
    forced,
    greedy_divergence,
    make_engine,
    prompt_stats,
    run,
    warm,
)
from bench.quality.report import report
from bench.quality.runs import run_prompts, summaries
from bench.quality.sessions import CONT, chain_runs, mxfp8_variant, windows
from bench.quality.trace import add_trace_args, trace_variant
from services.engine.build import DEFAULT_CHECKPOINTS
from services.engine.cache.layout import RuntimeLayout
from services.engine.config import EngineConfig, preset
from services.engine.model import weights as weights_mod
from training import data

NAMES = {1: "1 truncation compact vs off", 2: "2 snapshot hit vs cold", 3: "3 bounded replay vs cold"}


class Singles:
    """Variants 1-3 at one prompt length: one engine per configuration, built on first use
    and reused for every group of prompts."""

    def __init__(self, a, cfg, w, length: int, wanted: set[int]):
        self.a, self.cfg, self.w, self.length, self.wanted = a, cfg, w, length, wanted
        self.l1 = (length - a.keep) // cfg.block_size * cfg.block_size
        self.engines: dict[str, object] = {}

    def engine(self, name: str, per_prompt: int, **ecfg):
        if name not in self.engines:
            self.engines[name] = make_engine(self.cfg, self.w, per_prompt * self.a.group,
                                             self.length + CONT, self.a.chunk, **ecfg)
        return self.engines[name]

    def group(self, items: list[tuple[int, list[int], list[int]]]) -> list[dict]:
        """items: (prompt index, prompt, continuation) -> one record per prompt."""
        a, want = self.a, self.wanted
        out = {i: {"i": i} for i, _, _ in items}
        off = None
        if 1 in want:
            off = run(self.engine("off", 2, truncation="off"),
                      [r for i, p, c in items for r in (forced(f"f{i}", p, c, f"o:{i}"),
                                                        Req(f"g{i}", p, f"og:{i}", greedy=len(c)))])
        reqs = [forced(f"f{i}", p, c, f"c:{i}") for i, p, c in items]
        if want & {2, 3}:
            reqs += [Req(f"g{i}", p, f"cg:{i}", greedy=len(c)) for i, p, c in items]
        if off is not None:
            reqs += [Req(f"g{i}", p, f"cg:{i}", greedy=len(c)) for i, p, c in items if not want & {2, 3}]
        comp = run(self.engine("compact", 2, truncation="compact", keep_tokens=a.keep), reqs)
        if off is not None:         # both paths decode free-running here: compared token by token
            for i, _, c in items:
                out[i]["v1"] = self._stats(off, comp, i, c)
        for v, policy in ((2, "full"), (3, "zero")):
            if v not in want:
                continue
            eng = self.engine(policy, 2, truncation="compact", keep_tokens=a.keep, swa_policy=policy)
            warm(eng, [(f"{i}", p[: self.l1 + 1], f"{policy}:{i}") for i, p, _ in items])
            hit = run(eng, [r for i, p, c in items
                            for r in (forced(f"f{i}", p, c, f"{policy}:{i}"),
                                      forced(f"h{i}", p, comp[f"g{i}"].tokens, f"{policy}:{i}"))])
            for i, _, c in items:
                assert hit[f"f{i}"].cached == hit[f"h{i}"].cached, f"prompt {i} saw two cache states"
                out[i][f"v{v}"] = self._stats(comp, hit, i, c, f"h{i}")
        return list(out.values())

    @staticmethod
    def _stats(exact, variant, i: int, cont: list[int], on_greedy: str = "") -> dict:
        v = variant[f"f{i}"]
        s = prompt_stats(exact[f"f{i}"].logits, v.logits, cont)
        g = exact[f"g{i}"].tokens
        if on_greedy:       # the variant's greedy, read from its forced pass over g
            s.update(greedy_divergence(g, variant[on_greedy].logits.argmax(-1).tolist()))
        else:
            s.update(greedy_divergence(g, variant[f"g{i}"].tokens))
        return {**s, "replayed": v.replayed, "cached": v.cached, "snapshot_hit": v.snapshot_hit}


def single_variants(a, cfg, w, val, wanted: set[int]) -> dict:
    res = {}
    for length in a.lengths:
        path = OUT / f"replay_quality_L{length}_N{a.prompts}.jsonl"
        done = run_prompts(a, path, length, wanted,
                           lambda length=length: windows(val, a.prompts, length + CONT),
                           lambda length=length: Singles(a, cfg, w, length, wanted), CONT)
        res.update(summaries(done, wanted, NAMES, length))
    return res


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINTS["tiny"]))
    p.add_argument("--prompts", type=int, default=200, help="held-out prompts per length (variants 1-3)")
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--group", type=int, default=2,
                   help="prompts per engine batch (variants 1-3): few sequences per step are cheapest")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prompt tokens per sequence per engine step")
    p.add_argument("--shard", default="0/1",
                   help="k/n: run every n-th prompt still to do, from the k-th (n processes, one file)")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier per-prompt results")
    p.add_argument("--merge-only", action="store_true", help="report the per-prompt results there are")
    p.add_argument("--keep", type=int, default=134, help="YOCO KEEP (>= W + B = 134)")
    p.add_argument("--sessions", type=int, default=8, help="chained sessions (variant 5)")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--chain-start", type=int, default=1024, help="first turn's prompt length")
    p.add_argument("--chain-policies", default="zero/share,zero/isolate",
                   help="variant 5's policy/replay-blocks configs")
    add_trace_args(p, 4)
    p.add_argument("--mxfp8-prompts", type=int, default=8, help="prompts of variant 6")
    p.add_argument("--mxfp8-greedy", type=int, default=CONT, help="greedy tokens of variant 6")
    p.add_argument("--variants", default="1,2,3,4,5,6")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT / "replay_quality.json"))
    a = p.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.shard = tuple(int(x) for x in a.shard.split("/"))
    wanted = {int(x) for x in a.variants.split(",")}
    torch.set_num_threads(a.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = preset("tiny")
    w = weights_mod.load(a.checkpoint, cfg)
    val = data.load_corpus().val
    t0 = time.perf_counter()
    results = single_variants(a, cfg, w, val, wanted & {1, 2, 3}) if wanted & {1, 2, 3} else {}
    chains = chain_runs(a, cfg, w, val) if 5 in wanted and not a.merge_only else {}
    trace = {}
    if 4 in wanted and not a.merge_only:
        probe = EngineConfig(truncation="compact", keep_tokens=a.keep)
        trace = trace_variant(
            a, lambda n, longest, **kw: make_engine(cfg, w, n, longest, a.chunk, **kw), run, val,
            RuntimeLayout.build(cfg, probe).block.state_size_to_disk)
    if 6 in wanted and not a.merge_only:
        results[f"6 MXFP8 vs unquantized SWA KV, L={a.lengths[0]}"] = mxfp8_variant(a, cfg, w, val)
    report(results, chains, trace, a)
    Path(a.out).write_text(json.dumps({"args": vars(a), "single": results, "chains": chains,
                                       "trace": trace, "seconds": time.perf_counter() - t0},
                                      indent=1) + "\n")
    print(f"results: {a.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
