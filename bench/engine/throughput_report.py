"""The report of bench/engine/throughput.py: its tables (decode step time, floor, tokens/s,
the prefill bound, the scheduler mix, inter-token latency) and its plot, from the result
dicts the bench writes (this checkout's, and an older checkout's beside it)."""

from __future__ import annotations

from bench.common import OUT, plot, table


def floor_rows(res: dict, batches: tuple) -> list[list]:
    """[batch, step ms, matmul ms, attention ms, ring read ms, rest ms, best x, read x]: best
    x is the ratio step(b) / step(1) would have if only the matmuls and the attention grew
    with the batch (the rest of step(1) paid once per step): (step(1) + d matmul + d
    attention) / step(1); read x the same with the attention at the ring read's cost."""
    st = {int(k): v for k, v in res["step_s"].items()}
    fl = {k: {int(b): v for b, v in d.items()} for k, d in res["floors"].items() if k != "prefill_matmul"}
    rows = []
    for b in batches:
        mm, at = fl["matmul"][b], fl["attention"][b]
        rd = fl.get("read", fl["attention"])[b]
        grow = mm - fl["matmul"][1]
        rows.append([b, st[b] * 1e3, mm * 1e3, at * 1e3, rd * 1e3, (st[b] - mm - at) * 1e3,
                     (st[1] + grow + at - fl["attention"][1]) / st[1],
                     (st[1] + grow + rd - fl.get("read", fl["attention"])[1]) / st[1]])
    return rows


def _e2e_vs_seq(t: dict) -> float:
    """End to end at N over one after another: measured per round (this bench), else from
    the rates (an older run's JSON, which timed the sequential requests once, before every N)."""
    return t.get("e2e_vs_seq", t["e2e_tok_s"] / t["seq_tok_s"])


def _span(t: dict, key: str) -> str:
    lo, hi = t.get(key, (float("nan"), float("nan")))
    return f"{lo:.2f}-{hi:.2f}"


def prefill_rows(res: dict, batches: tuple) -> list[list]:
    """What bounds end to end: prefill share = seconds of the steps that carry prefill work /
    all seconds of the N-request run (decode rows riding along included); if every
    decode-only step were free, e2e vs seq could reach at most (e2e vs seq) / that share.
    seq prefill share: the same share for one request alone."""
    rows = []
    for n in batches:
        t = res["tput"][str(n)] if str(n) in res["tput"] else res["tput"][n]
        if "seq_prefill_share" not in t:
            continue
        e2e = _e2e_vs_seq(t)
        rows.append([n, e2e, t["prefill_share"], e2e / t["prefill_share"], t["seq_prefill_share"]])
    return rows


def report(res: dict, before: dict | None, batches: tuple, prefill_rows_n: int) -> None:
    """The tables and the plot of one run (res), beside an older checkout's (before)."""
    print(f"\nclock: {res['args']['clock']} seconds ({res['args'].get('threads', 1)} torch thread(s))")
    cols = [("before", before), ("after", res)] if before else [(res["label"], res)]
    st = lambda r, b: r["step_s"][str(b)] if str(b) in r["step_s"] else r["step_s"][b]  # noqa: E731
    tp = lambda r, b: r["tput"][str(b)] if str(b) in r["tput"] else r["tput"][b]  # noqa: E731
    rows = []
    for b in batches:
        row = [b]
        for _, r in cols:
            row += [st(r, b) * 1e3, st(r, b) / st(r, 1)]
        rows.append(row)
    print("\ndecode step time (ms)")
    print(table(["batch"] + [f"{n} {h}" for n, _ in cols for h in ("ms", "x batch1")], rows))
    print(f"\nfloor ({cols[-1][0]}): what grows with the batch, each alone; rest = step - matmul - "
          "attention; best x = (step(1) + d matmul + d attention) / step(1); read x: the same "
          "with the attention costing only one read of the fp32 rings")
    print(table(["batch", "step ms", "matmul ms", "attention ms", "ring read ms", "rest ms", "best x",
                 "read x"], floor_rows(res, batches)))
    rows = []
    for n in batches:
        row = [n]
        for _, r in cols:
            t = tp(r, n)
            e2e = _e2e_vs_seq(t)
            dec = t.get("dec_vs_1", t["dec_tok_s"] / tp(r, 1)["dec_tok_s"])   # likewise
            row += [t["e2e_tok_s"], e2e, _span(t, "e2e_vs_seq_range"), t["dec_tok_s"], dec,
                    _span(t, "dec_vs_1_range")]
        rows.append(row)
    print("\ngenerated tokens/s (e2e = with prefills; vs seq = / same requests one after another; "
          "vs N=1 = decode-only tok/s / one request's alone; ratios: the median of rounds that "
          "each ran one request alone and then the N together, back to back, and their range)")
    print(table(["N"] + [f"{n} {h}" for n, _ in cols for h in ("e2e tok/s", "vs seq", "range",
                                                                 "decode tok/s", "vs N=1", "range")],
                rows))
    if rows := prefill_rows(res, batches):
        print(f"\nend to end vs the prefill floor ({cols[-1][0]}): prefill share = seconds of steps "
              "with prefill work / all; decode free = e2e vs seq / prefill share, the most end to "
              "end reaches if decode-only steps cost nothing")
        print(table(["N", "e2e vs seq", "prefill share", "decode free", "seq prefill share"], rows))
    if pm := res["floors"].get("prefill_matmul"):
        f32, b16 = pm["float32"], pm["bfloat16"]
        print(f"prefill floor: the weight matmuls of one {prefill_rows_n}-row step take {f32 * 1e3:.1f} ms "
              f"in fp32, {b16 * 1e3:.1f} ms in bf16 on this CPU ({f32 / b16:.1f}x): the design change "
              "that would move the prefill bound (bf16 serving; the targets are fp32)")
    if res.get("budgets"):
        seq = tp(res, 32)["seq_tok_s"]
        print(f"\nscheduler mix ({cols[-1][0]}), N = 32 end to end by max_batched_tokens")
        print(table(["budget", "e2e tok/s", "vs seq", "prefill share"],
                    [[int(b), r["e2e_tok_s"], r["e2e_tok_s"] / seq, r["prefill_share"]]
                     for b, r in res["budgets"].items()]))
    it = cols[-1][1]["itl"]
    rounds = it.get("rounds", 1)
    print(f"\ninter-token latency, 16 decoding streams (ms): {rounds} round(s) of "
          f"{it.get('alone_steps', 20) // rounds} decode-only steps, then a {res['args']['long']}-token "
          f"prompt prefilled beside them; steps = decode-only + beside, all rounds; p99 x = "
          f"prefill_p99 / alone_p50; prompt s = the long prompt's time to first token beside the "
          f"streams (a round's mean)")
    keys = ("alone_p50", "alone_p99", "prefill_p50", "prefill_p90", "prefill_p99", "prefill_max")
    print(table(["run"] + list(keys) + ["p99 x", "prompt s", "steps"],
                [[n] + [r["itl"].get(k, float("nan")) * 1e3 for k in keys] +
                 [r["itl"]["prefill_p99"] / r["itl"]["alone_p50"], r["itl"].get("prompt_s", float("nan")),
                  f"{r['itl'].get('alone_steps', 20)}+{r['itl']['prefill_steps']}"]
                 for n, r in cols]))
    print("\ntargets: step(32) <= 2 x step(1); decode tok/s at N=32 >= 12 x N=1; e2e at N=32 >= 5 x "
          "sequential; ITL p99 beside a 4K prefill <= 3 x p50 alone")
    series = {f"{n} step time": (list(batches), [st(r, b) * 1e3 for b in batches]) for n, r in cols}
    series.update({f"{n} decode tok/s": (list(batches), [tp(r, b)["dec_tok_s"] for b in batches])
                   for n, r in cols})
    path = plot(OUT / "engine_throughput.png", f"tiny, fp32, {res['args'].get('threads', 1)} thread(s): decode step ms / decode tok/s",
                "batch (concurrent requests)", "ms | tokens/s", series)
    print(f"plot: {path}")
