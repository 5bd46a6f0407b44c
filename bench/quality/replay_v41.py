"""What bounded replay, prefill truncation and MXFP8 cost in quality on the shipped DeepSeek
V4.1-layout model (models/deepseek-v41-tiny), served by the real engine.

Held-out stdlib files (never trained on), each prompt followed by its true 64-token
continuation. Every variant runs in an in-process Engine (float32, MXFP8 window rows, as
served) against the exact path for the same prompts:

    1 truncation   compact cold                vs  off cold      (what truncation costs)
    2 snapshot     compact, snapshot hit       vs  compact cold  (must be exact)
    3 replay       compact, bounded replay     vs  compact cold  (encoder-side replay of
                   the 128 tokens before the hit; the decoder from the cut, as cold)
    4 replay off   off, bounded replay         vs  off cold      (no truncation: the encoder
                   and the decoder layers both replay the 128 tokens before the hit)
    5 chains       sessions of 1..T turns, each appending 200-500 tokens and hitting the
                   previous turn's blocks through replay (compact, policy zero); blocks
                   completed after a replay shared (`--replay-blocks share`) or not (`isolate`)
    6 mxfp8        the engine (off, cold: MXFP8 window rows) vs the full-sequence forward
                   (V41Model.logits: unquantized rows)
    7 policies     a request trace (sessions over shared prefixes, multi-turn follow-ups,
                   waves of concurrent arrivals, users back from a break) served under each
                   --swa-policy full | periodic:N | zero: hit rate, cost, quality against
                   cold compact (bench/quality/trace.py)

Variants 2 and 3 re-send a prompt the engine has run (same salt): its blocks are cached,
under `--swa-policy full` with the snapshot at the deepest boundary before the decoder's
cut, under `zero` without. Metrics: mean per-token KL(exact ||
variant) over the teacher-forced continuation, the relative perplexity change on it, and
greedy agreement (prompts whose 64 greedy tokens are all identical; the mean position of
the first difference). bench/quality/v41_harness.py says how a continuation is forced.

Held-out windows are evenly spaced over the held-out code stream (376,587 tokens), so at
4K tokens neighbouring prompts overlap. Per-prompt results go to
bench/out/replay_quality_v41_L{L}_N{N}.jsonl, and a run resumes from them (--fresh starts
over; --merge-only reports what is there).

Targets (docs/design.md §6, §14): a snapshot hit identical to cold; one bounded replay
<= 1 % perplexity increase and >= 90 % of prompts with 64 identical greedy tokens; chained
replays <= 2 %.

Usage: python -m bench.quality.replay_v41 [--prompts 200] [--lengths 1024,4096]
       [--variants 1,2,3,4,5,6,7] [--sessions 8] [--turns 8] [--model DIR]
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from bench.common import OUT, load_model, parser, plot
from bench.quality.forcing import Req, aggregate, forced, greedy_divergence, prompt_stats
from bench.quality.report import report
from bench.quality.runs import run_prompts, summaries
from bench.quality.trace import add_trace_args, trace_variant
from bench.quality.v41_harness import CHUNK, make_engine, run
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.training import data, v41_data

CONT = 64
NAMES = {1: "1 truncation compact vs off", 2: "2 snapshot hit vs cold (compact)",
         3: "3 bounded replay vs cold (compact)", 4: "4 bounded replay vs cold (off)",
         6: "6 engine (MXFP8 rows) vs full forward"}


def held_out(model_dir: str) -> torch.Tensor:
    """The held-out code stream in the model's tokenizer (the files data.split holds out)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    root, files = v41_data.sources()["code"]
    return v41_data.encode(tok, root, data.split(files)[1], "code")


def windows(val: torch.Tensor, n: int, length: int) -> list[list[int]]:
    return [r[:length].tolist() for r in data.eval_windows(val, n, length)]


class Singles:
    """Variants 1-4 and 6 at one prompt length: one engine per configuration, built on first
    use and reused for every group of prompts."""

    def __init__(self, a, model, tok, length: int, wanted: set[int]):
        self.a, self.model, self.tok, self.length, self.wanted = a, model, tok, length, wanted
        self.engines: dict[str, object] = {}
        # variant 6's exact side: the same weights, window rows unrounded
        self.unrounded = V41Model(model.cfg, model.weights, model.dtype)

    def engine(self, name: str, per_prompt: int, **ecfg):
        if name not in self.engines:
            self.engines[name] = make_engine(self.model, self.tok, per_prompt * self.a.group,
                                             self.length + CONT, self.a.chunk, **ecfg)
        return self.engines[name]

    def group(self, items: list[tuple[int, list[int], list[int]]]) -> list[dict]:
        """items: (prompt index, prompt, continuation) -> one record per prompt."""
        a, want = self.a, self.wanted
        out = {i: {"i": i} for i, _, _ in items}
        cold = lambda tag: [r for i, p, c in items for r in (   # noqa: E731
            forced(f"f{i}", p, c, f"{tag}:{i}"), Req(f"g{i}", p, f"{tag}g:{i}", greedy=len(c)))]
        off = run(self.engine("off", 2, truncation="off"), cold("o")) if want & {1, 4, 6} else None
        comp = run(self.engine("compact", 2, truncation="compact", keep_tokens=a.keep),
                   cold("c")) if want & {1, 2, 3} else None
        if 1 in want:
            for i, _, c in items:
                out[i]["v1"] = self._stats(off, comp, i, c, greedy_of=comp)
        hits = [(2, comp, "full", dict(truncation="compact", keep_tokens=a.keep)),
                (3, comp, "zero", dict(truncation="compact", keep_tokens=a.keep)),
                (4, off, "zero", dict(truncation="off"))]
        for v, exact, policy, ecfg in hits:
            if v not in want:
                continue
            eng = self.engine(f"v{v}", 2, swa_policy=policy, **ecfg)
            run(eng, [Req(f"w{i}", p, f"v{v}:{i}", greedy=1) for i, p, _ in items])  # caches it
            hit = run(eng, [r for i, p, c in items
                            for r in (forced(f"f{i}", p, c, f"v{v}:{i}"),
                                      forced(f"h{i}", p, exact[f"g{i}"].tokens, f"v{v}:{i}"))])
            for i, _, c in items:
                assert hit[f"f{i}"].cached == hit[f"h{i}"].cached, f"prompt {i} saw two cache states"
                out[i][f"v{v}"] = self._stats(exact, hit, i, c, on_greedy=f"h{i}")
        if 6 in want:
            for i, p, c in items:
                out[i]["v6"] = self._reference(off, i, p, c)
        return list(out.values())

    @staticmethod
    def _stats(exact, variant, i: int, cont: list[int], on_greedy: str = "",
               greedy_of=None) -> dict:
        v = variant[f"f{i}"]
        s = prompt_stats(exact[f"f{i}"].logits, v.logits, cont)
        g = exact[f"g{i}"].tokens
        if on_greedy:       # the variant's greedy, read from its forced pass over g
            s.update(greedy_divergence(g, variant[on_greedy].logits.argmax(-1).tolist()))
        else:
            s.update(greedy_divergence(g, greedy_of[f"g{i}"].tokens))
        return {**s, "replayed": v.replayed, "cached": v.cached, "snapshot_hit": v.snapshot_hit}

    @torch.no_grad()
    def _reference(self, off, i: int, prompt: list[int], cont: list[int]) -> dict:
        """The full-sequence forward (unquantized) as exact, the engine's off path as the
        variant: KL on the continuation, and the engine's greedy against the reference's
        (read from a forced pass of the reference over the engine's greedy tokens)."""
        n = len(prompt)
        ref = self.unrounded.logits(torch.tensor(prompt + cont[:-1]))[n - 1:]
        s = prompt_stats(ref, off[f"f{i}"].logits, cont)
        g = off[f"g{i}"].tokens
        on_g = self.unrounded.logits(torch.tensor(prompt + g[:-1]))[n - 1:].argmax(-1).tolist()
        return {**s, **greedy_divergence(g, on_g)}


def single_variants(a, model, tok, val, wanted: set[int]) -> dict:
    res = {}
    for length in a.lengths:
        path = OUT / f"replay_quality_v41_L{length}_N{a.prompts}.jsonl"
        done = run_prompts(a, path, length, wanted,
                           lambda length=length: windows(val, a.prompts, length + CONT),
                           lambda length=length: Singles(a, model, tok, length, wanted), CONT)
        res.update(summaries(done, wanted, NAMES, length))
    return res


def chain_runs(a, model, tok, val) -> dict:
    """Variant 5: every session's turns on one engine per replay-blocks config (compact,
    policy zero; one salt per session: turn t + 1 hits turn t's blocks), each turn against
    a cold compact run of the same prompt (run once for both configs)."""
    rng = random.Random(a.seed)
    lens = []
    for _ in range(a.sessions):
        ls = [a.chain_start]
        for _ in range(a.turns - 1):
            ls.append(ls[-1] + rng.randint(200, 500))
        lens.append(ls)
    longest = max(ls[-1] for ls in lens) + CONT
    texts = windows(val, a.sessions, longest)
    n = len(texts)

    def turn(i, t):
        return texts[i][: lens[i][t]], texts[i][lens[i][t]: lens[i][t] + CONT]

    compact = dict(truncation="compact", keep_tokens=a.keep)
    t0, exact = time.perf_counter(), {}
    eng = make_engine(model, tok, 2 * n, longest, a.chunk, **compact)
    for t in range(a.turns):
        got = run(eng, [r for i in range(n) for p, c in [turn(i, t)]
                        for r in (forced(f"f{i}", p, c, f"cold:{i}:{t}"),
                                  Req(f"g{i}", p, f"coldg:{i}:{t}", greedy=CONT))])
        exact.update({f"{k}:{t}": v for k, v in got.items()})
    print(f"chains: exact turns in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for blocks in a.chain_blocks.split(","):
        t0 = time.perf_counter()
        eng = make_engine(model, tok, 2 * n, longest, a.chunk, swa_policy="zero",
                          replay_blocks=blocks, **compact)
        per_turn = []
        for t in range(a.turns):
            got = run(eng, [r for i in range(n) for p, c in [turn(i, t)]
                            for r in (forced(f"f{i}", p, c, f"sess:{i}"),
                                      forced(f"h{i}", p, exact[f"g{i}:{t}"].tokens, f"sess:{i}"))])
            recs = []
            for i in range(n):
                v = got[f"f{i}"]
                assert v.cached == got[f"h{i}"].cached, f"session {i} saw two cache states"
                recs.append({**prompt_stats(exact[f"f{i}:{t}"].logits, v.logits, turn(i, t)[1]),
                             **greedy_divergence(exact[f"g{i}:{t}"].tokens,
                                                 got[f"h{i}"].logits.argmax(-1).tolist()),
                             "replayed": v.replayed, "cached": v.cached,
                             "snapshot_hit": v.snapshot_hit})
            per_turn.append(aggregate(recs))
        out[f"zero/{blocks}"] = per_turn
        print(f"chains zero/{blocks}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def policy_trace(a, model, tok, val) -> dict:
    """Variant 7: the request trace under each --policies value."""
    def make(n, longest, **ecfg):
        return make_engine(model, tok, n, longest, a.chunk, **ecfg)

    snap_bytes = make(1, 1024, truncation="compact", keep_tokens=a.keep).prefix.snapshot_bytes
    return trace_variant(a, make, run, val, snap_bytes)


def plot_singles(results: dict, path: Path) -> Path:
    """Perplexity change per variant and length (a bar per result, as points on a line)."""
    series: dict[str, tuple[list, list]] = {}
    for name, r in results.items():
        variant, length = name.rsplit(", L=", 1)
        xs, ys = series.setdefault(variant, ([], []))
        xs.append(int(length))
        ys.append(max(r["kl_mean"], 1e-9))
    return plot(path, "DeepSeek V4.1 tiny: KL(exact || variant) per continuation token",
                "prompt tokens", "mean per-token KL (nats)", series, logx=True, logy=True)


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="a V4.1 checkpoint directory")
    p.add_argument("--prompts", type=int, default=200, help="held-out prompts per length")
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--group", type=int, default=4, help="prompts per engine batch")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prompt tokens per sequence per step")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) earlier per-prompt results")
    p.add_argument("--merge-only", action="store_true", help="report the per-prompt results there are")
    p.add_argument("--keep", type=int, default=134, help="truncation KEEP (>= W + B = 134)")
    p.add_argument("--sessions", type=int, default=8, help="chained sessions (variant 5)")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--chain-start", type=int, default=1024, help="first turn's prompt length")
    p.add_argument("--chain-blocks", default="share,isolate", help="variant 5's --replay-blocks values")
    add_trace_args(p, 7)
    p.add_argument("--variants", default="1,2,3,4,5,6,7")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT / "replay_quality_v41.json"))
    a = p.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    wanted = {int(x) for x in a.variants.split(",")}
    torch.set_num_threads(a.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(a.model)
    val = held_out(a.model)
    t0 = time.perf_counter()
    singles = wanted - {5, 7}
    results = single_variants(a, model, tok, val, singles) if singles else {}
    chains = chain_runs(a, model, tok, val) if 5 in wanted and not a.merge_only else {}
    trace = policy_trace(a, model, tok, val) if 7 in wanted and not a.merge_only else {}
    report(results, chains, trace, a)
    if results:
        print(f"plot: {plot_singles(results, OUT / 'replay_quality_v41.png')}")
    Path(a.out).write_text(json.dumps({"args": vars(a), "single": results, "chains": chains,
                                       "trace": trace, "seconds": time.perf_counter() - t0},
                                      indent=1) + "\n")
    print(f"results: {a.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
