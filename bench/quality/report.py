"""Tables and plots of the replay-quality benchmark (bench/quality/replay_v41.py; PNG into
bench/out/)."""

from __future__ import annotations

from bench.common import OUT, plot, table


def _mean(per: list[dict], key: str) -> float:
    """Mean over turns 2.. (turn 1 is cold in every config)."""
    rest = per[1:] or per
    return sum(r[key] for r in rest) / len(rest)


def report(results: dict, chains: dict, trace: dict, a) -> None:
    if results:
        head = ["variant", "prompts", "KL mean", "KL max", "ppl change %", "greedy identical %",
                "first diff", "replayed", "snap hit %"]
        print(table(head, [[k, r["prompts"], f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}",
                            f"{r['ppl_change_pct']:+.3f}", f"{r['greedy_identical_pct']:.1f}",
                            f"{r['first_divergence_mean']:.1f}", f"{r.get('replayed_mean', 0):.0f}",
                            f"{100 * r.get('snapshot_hit_mean', 0):.0f}"] for k, r in results.items()]))
    if chains:
        _chains(chains, a)
    if trace:
        _trace(trace, a)


def _chains(chains: dict, a) -> None:
    print(f"\nchained sessions ({a.sessions} sessions, prompt {a.chain_start} tokens + 200-500 per turn),"
          " per turn: KL mean / ppl change % / greedy identical %")
    turns = list(range(1, a.turns + 1))
    print(table(["config"] + [f"turn {t}" for t in turns],
                [[k] + [f"{r['kl_mean']:.1e} / {r['ppl_change_pct']:+.2f} / {r['greedy_identical_pct']:.0f}"
                        for r in per] for k, per in chains.items()]))
    print(table(["config", "snapshot hit %", "replayed tokens / turn", "cached tokens / turn",
                 "KL mean (turns 2..)", "ppl change % (turns 2..)", "worst turn ppl %"],
                [[k, f"{100 * _mean(per, 'snapshot_hit_mean'):.0f}", f"{_mean(per, 'replayed_mean'):.0f}",
                  f"{_mean(per, 'cached_mean'):.0f}", f"{_mean(per, 'kl_mean'):.2e}",
                  f"{_mean(per, 'ppl_change_pct'):+.3f}", f"{max(r['ppl_change_pct'] for r in per):+.3f}"]
                 for k, per in chains.items()]))
    path = plot(OUT / "replay_quality_chain.png", "KL(exact || chained replay) per turn",
                "turn (replays so far = turn - 1)", "mean per-token KL (nats)",
                {k: (turns, [max(r["kl_mean"], 1e-9) for r in per]) for k, per in chains.items()},
                logx=False, logy=True)
    print(f"plot: {path}")


def _trace(trace: dict, a) -> None:
    any_r = next(iter(trace.values()))
    print(f"\nrequest trace ({any_r['requests']} requests of {a.trace_sessions} sessions, mean prompt "
          f"{any_r['prompt_mean']:.0f} tokens; snapshot store {a.trace_snapshots} snapshots, "
          f"{a.trace_cache_blocks} cached blocks beyond the running requests')")
    print(table(["--swa-policy", "snapshot %", "replay %", "miss %", "computed tokens / req",
                 "TTFT mean ms", "TTFT p90 ms", "KL mean", "KL on replays", "ppl change %",
                 "snapshots stored", "preempted"],
                [[k, f"{r['snapshot_pct']:.0f}", f"{r['replay_pct']:.0f}", f"{r['miss_pct']:.0f}",
                  f"{r['computed_mean']:.0f}", f"{r['ttft_ms_mean']:.0f}", f"{r['ttft_ms_p90']:.0f}",
                  f"{r['kl_mean']:.2e}", f"{r.get('kl_replay', 0):.2e}", f"{r['ppl_change_pct']:+.3f}",
                  r["snapshot_stores"], r["preemptions"]] for k, r in trace.items()]))
    path = plot(OUT / "replay_quality_policies.png", "SWA policy over the request trace: cost vs quality",
                "prompt tokens computed per request", "mean per-token KL vs exact (nats)",
                {k: ([r["computed_mean"]], [max(r["kl_mean"], 1e-9)]) for k, r in trace.items()},
                logx=False, logy=True)
    print(f"plot: {path}")
    print(table(["--swa-policy"] + [f"turn {t + 1}" for t in range(len(any_r["kl_by_turn"]))],
                [[k] + [f"{x:.1e}" for x in r["kl_by_turn"]] for k, r in trace.items()]))
    path = plot(OUT / "replay_quality_trace_turns.png", "KL(exact || served) by session turn, request trace",
                "turn of the session", "mean per-token KL (nats)",
                {k: (list(range(1, len(r["kl_by_turn"]) + 1)), [max(x, 1e-10) for x in r["kl_by_turn"]])
                 for k, r in trace.items()}, logx=False, logy=True)
    print(f"plot: {path}")
