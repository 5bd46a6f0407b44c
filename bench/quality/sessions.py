"""Variants 5 (chained replays over multi-turn sessions) and 6 (MXFP8 vs unquantized SWA
KV) of bench/quality/replay.py, and the held-out windows every variant draws from."""

from __future__ import annotations

import random
import time

import torch

from bench.quality.forcing import (
    Req,
    aggregate,
    forced,
    greedy_divergence,
    make_engine,
    prompt_stats,
    run,
)
from training import data
from training.model import forward

CONT = 64


def windows(val, n: int, length: int) -> list[list[int]]:
    """n evenly spaced held-out windows of `length` tokens."""
    return [r[:length].tolist() for r in data.eval_windows(val, n, length)]


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


def chain_runs(a, cfg, w, val) -> dict:
    """Variant 5: every session's turns on one engine per policy/replay-blocks config (one
    salt per session: turn t + 1 hits turn t's blocks), each turn against a cold compact
    computation of the same prompt (computed once for all configs)."""
    texts, lens = session_texts(a, val)
    longest = max(ls[-1] for ls in lens) + CONT
    n = len(texts)

    def turn(i, t):
        return texts[i][: lens[i][t]], texts[i][lens[i][t]: lens[i][t] + CONT]

    t0 = time.perf_counter()
    exact = {}
    eng = make_engine(cfg, w, 2 * n, longest, a.chunk, truncation="compact", keep_tokens=a.keep)
    for t in range(a.turns):
        got = run(eng, [r for i in range(n) for p, c in [turn(i, t)]
                        for r in (forced(f"f{i}", p, c, f"cold:{i}:{t}"),
                                  Req(f"g{i}", p, f"coldg:{i}:{t}", greedy=CONT))])
        exact.update({f"{k}:{t}": v for k, v in got.items()})
    print(f"chains: exact turns in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for config in a.chain_policies.split(","):
        policy, blocks = config.split("/")
        t0 = time.perf_counter()
        eng = make_engine(cfg, w, 2 * n, longest, a.chunk, truncation="compact", keep_tokens=a.keep,
                          swa_policy=policy, replay_blocks=blocks)
        per_turn = []
        for t in range(a.turns):
            got = run(eng, [r for i in range(n) for p, c in [turn(i, t)]
                            for r in (forced(f"f{i}", p, c, f"sess:{i}"),
                                      forced(f"h{i}", p, exact[f"g{i}:{t}"].tokens, f"sess:{i}"))])
            recs = []
            for i in range(n):
                v = got[f"f{i}"]
                assert v.cached == got[f"h{i}"].cached, f"session {i} saw two cache states"
                g = exact[f"g{i}:{t}"].tokens
                recs.append({**prompt_stats(exact[f"f{i}:{t}"].logits, v.logits, turn(i, t)[1]),
                             **greedy_divergence(g, got[f"h{i}"].logits.argmax(-1).tolist()),
                             "replayed": v.replayed, "cached": v.cached, "snapshot_hit": v.snapshot_hit})
            per_turn.append(aggregate(recs))
        out[config] = per_turn
        print(f"chains {config}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


@torch.no_grad()
def mxfp8_variant(a, cfg, w, val) -> dict:
    """Variant 6 with the training forward (the reference's math; quantize on or off): the
    unquantized model decodes greedy, the quantized one is forced over those tokens."""
    length = a.lengths[0]
    rows = windows(val, a.mxfp8_prompts, length + CONT)
    recs = []
    for r in rows:
        prompt, cont = r[:length], r[length:]
        seq = list(prompt)
        for _ in range(a.mxfp8_greedy):
            logits, _ = forward(w, cfg, torch.tensor(seq)[None], chunk=cfg.window, quantize=False)
            seq.append(int(logits[0, -1].argmax()))
        greedy = seq[length:]
        lp = {}
        for q in (False, True):
            logits, _ = forward(w, cfg, torch.tensor(r)[None, :-1], chunk=cfg.window, quantize=q)
            lp[q] = logits[0, length - 1:]
        on_greedy, _ = forward(w, cfg, torch.tensor(prompt + greedy[:-1])[None], chunk=cfg.window,
                               quantize=True)
        recs.append({**prompt_stats(lp[False], lp[True], cont),
                     **greedy_divergence(greedy, on_greedy[0, length - 1:].argmax(-1).tolist())})
    out = aggregate(recs)
    out["greedy_tokens"] = a.mxfp8_greedy
    return out
