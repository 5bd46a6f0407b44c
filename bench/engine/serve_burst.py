"""Does batching pay over the engine's gRPC API, with the flags a user gets by default?

Starts `kvmesh engine serve` (the shipped default model, default flags unless --flags adds
some), then on that one engine, same run:

    sequential  N distinct P-token prompts, one after another, T greedy tokens each
    burst       N other distinct P-token prompts sent at once

and reports, per phase: generated tokens/s end to end, TTFT p50/p99, ITL p50/p99 (the gaps
between a stream's messages), and how many streams were decoding at once (a stream decodes
from its first token to its last), at peak and on average over the time any decoded.
Then 16 streams decode while a 4096-token prompt arrives beside them: their gaps while it
is prefilled against their gaps just before, and its time to first token.
Targets (issue 45): burst end to end >= 4x sequential, peak concurrent decoding >= 24, burst
ITL p99 <= 4x the sequential ITL p50.

Each --flags value is its own engine (started, measured, stopped) so a policy and the
defaults are compared in one run:

    python -m bench.engine.serve_burst                                    # defaults only
    python -m bench.engine.serve_burst --flags "" --flags "--step-slo-ms 0"

Writes bench/out/serve_burst.json and .png.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.common import OUT, ROOT, model_vocab, parser, pct, prompts, table, worktree
from kvmesh.launch.backing.proc import free_port
from kvmesh.services.engine.rpc.client import EngineClient

KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]


class Engine:
    """One `kvmesh engine serve` process on a free port, its log in bench/out."""

    def __init__(self, flags: list[str], log: Path, root: Path = ROOT):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        argv = [*KVMESH, "engine", "serve", "--port", str(self.port), *flags]
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=root, env=env)

    async def ready(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}; see {self._log.name}")
            client = EngineClient(self.address)
            try:
                info = await client.model_info()
                return {"model": info.model_name} if hasattr(info, "model_name") else {}
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
            finally:
                await client.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


async def one(client: EngineClient, prompt: list[int], tokens: int, rec: dict | None = None
              ) -> dict:
    """One streamed generation: when it was sent, and when each message arrived (filled in
    `rec` as they come, for a caller that watches)."""
    rec = {"arrivals": [], "tokens": 0} if rec is None else rec
    rec["sent"] = time.perf_counter()
    async for msg in client.generate(prompt, max_tokens=tokens, temperature=0.0,
                                     ignore_eos=True, speculative="off"):
        if msg.token_ids:
            rec["arrivals"].append(time.perf_counter())
            rec["tokens"] += len(msg.token_ids)
    return rec


async def beside(client: EngineClient, vocab: int, streams: int, long: int) -> dict:
    """`streams` requests decoding, then a `long`-token prompt arrives: their gaps while it
    is prefilled (from its sending to its first token) against their gaps in the 2 s before,
    and its time to first token."""
    recs = [{"arrivals": [], "tokens": 0} for _ in range(streams)]
    tasks = [asyncio.create_task(one(client, p, 2000, r))
             for p, r in zip(prompts(streams, 64, vocab, 3), recs, strict=True)]
    while min(len(r["arrivals"]) for r in recs) < 2:
        await asyncio.sleep(0.05)
    await asyncio.sleep(2.0)
    new = await one(client, prompts(1, long, vocab, 4)[0], 1)
    sent, first = new["sent"], new["arrivals"][0]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [(b, b - a) for r in recs for a, b in zip(r["arrivals"], r["arrivals"][1:],
                                                       strict=False)]
    during = [g for t, g in gaps if sent < t <= first]
    alone = [g for t, g in gaps if sent - 2.0 <= t < sent]
    return {"streams": streams, "prompt_tokens": long, "ttft_ms": 1e3 * (first - sent),
            "alone_p50_ms": 1e3 * pct(alone, 0.5), "alone_p99_ms": 1e3 * pct(alone, 0.99),
            "during_p50_ms": 1e3 * pct(during, 0.5), "during_p99_ms": 1e3 * pct(during, 0.99),
            "during_max_ms": 1e3 * max(during), "gaps_during": len(during)}


def summarize(runs: list[dict], start: float, end: float) -> dict:
    ttft = [r["arrivals"][0] - r["sent"] for r in runs]
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    # streams decoding at once: +1 at a stream's first token, -1 at its last
    events = sorted([(r["arrivals"][0], 1) for r in runs] + [(r["arrivals"][-1], -1) for r in runs])
    now = peak = 0
    weighted, busy, last = 0.0, 0.0, events[0][0]
    for t, step in events:
        if now:
            weighted += now * (t - last)
            busy += t - last
        now += step
        peak = max(peak, now)
        last = t
    tokens = sum(r["tokens"] for r in runs)
    return {"tokens": tokens, "seconds": end - start, "tok_s": tokens / (end - start),
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "ttft_max_ms": 1e3 * max(ttft),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
            "peak_decoding": peak, "mean_decoding": weighted / busy if busy else 0.0}


async def measure(address: str, n: int, length: int, tokens: int, vocab: int,
                  beside_shape: tuple[int, int]) -> dict:
    client = EngineClient(address)
    try:
        await one(client, prompts(1, length, vocab, 999)[0], 4)        # warm-up
        seq_prompts, burst_prompts = prompts(n, length, vocab, 1), prompts(n, length, vocab, 2)
        start = time.perf_counter()
        seq = []
        for i, p in enumerate(seq_prompts):
            seq.append(await one(client, p, tokens))
            print(f"  sequential {i + 1}/{n}", end="\r", flush=True)
        seq_end = time.perf_counter()
        burst = await asyncio.gather(*(one(client, p, tokens) for p in burst_prompts))
        burst_end = time.perf_counter()
        side = None
        if beside_shape[0]:
            print(f"  {beside_shape[0]} streams beside a {beside_shape[1]}-token prompt", flush=True)
            side = await beside(client, vocab, *beside_shape)
    finally:
        await client.close()
    res = {"sequential": summarize(seq, start, seq_end),
           "burst": summarize(list(burst), seq_end, burst_end)}
    res["beside"] = side
    res["speedup"] = res["burst"]["tok_s"] / res["sequential"]["tok_s"]
    res["itl_p99_over_single_p50"] = res["burst"]["itl_p99_ms"] / res["sequential"]["itl_p50_ms"]
    return res


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--flags", action="append", default=None,
                   help="extra `engine serve` flags, one engine each (repeat to compare; "
                        "default: one engine with no extra flags)")
    p.add_argument("--before", default=None,
                   help="a git ref: also run that commit's engine first (from a worktree, its "
                        "own defaults with --before-flags), labelled 'before'")
    p.add_argument("--before-flags", default="--num-slots 32 --max-running 32")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--beside-streams", type=int, default=16,
                   help="streams decoding beside the long prompt (0: skip that phase)")
    p.add_argument("--beside-tokens", type=int, default=4096, help="the long prompt's tokens")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of the engine (default: unset, the engine's own "
                        "default: the CPUs less one)")
    args = p.parse_args()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    with contextlib.ExitStack() as trees:
        runs = [(f"before: {args.before_flags}", args.before_flags,
                 trees.enter_context(worktree(args.before)))] if args.before else []
        runs += [(flags or "defaults", flags, ROOT) for flags in args.flags or [""]]
        results = run_all(runs, args)
    report(results, args)
    return 0


def run_all(runs: list[tuple[str, str, Path]], args) -> dict:
    """{label: measure()'s figures} of one engine per (label, serve flags, tree), in turn."""
    results = {}
    for label, flags, root in runs:
        argv = shlex.split(flags)
        print(f"engine serve {label} ...", flush=True)
        engine = Engine(argv, OUT / f"serve_burst_{len(results)}.log", root)
        try:
            asyncio.run(engine.ready())
            results[label] = asyncio.run(measure(engine.address, args.requests,
                                                 args.prompt_tokens, args.tokens,
                                                 model_vocab(argv),
                                                 (args.beside_streams, args.beside_tokens)))
        finally:
            engine.stop()
    return results


def report(results: dict, args) -> None:
    rows = []
    for label, res in results.items():
        for phase in ("sequential", "burst"):
            s = res[phase]
            rows.append([label, phase, round(s["tok_s"], 1), round(s["ttft_p50_ms"]),
                         round(s["ttft_p99_ms"]), round(s["itl_p50_ms"], 1),
                         round(s["itl_p99_ms"], 1), s["peak_decoding"],
                         round(s["mean_decoding"], 1)])
    print(table(["flags", "phase", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "peak decoding", "mean decoding"], rows))
    print(table(["flags", "burst / sequential", "burst ITL p99 / single ITL p50"],
                [[label, f"{r['speedup']:.2f}x", f"{r['itl_p99_over_single_p50']:.2f}x"]
                 for label, r in results.items()]))
    if all(r["beside"] is not None for r in results.values()):
        print(f"{args.beside_streams} streams decoding while a {args.beside_tokens}-token prompt "
              "is prefilled beside them")
        print(table(["flags", "ITL p50 alone ms", "ITL p99 alone ms", "ITL p50 beside ms",
                     "ITL p99 beside ms", "max beside ms", "gaps", "long TTFT ms"],
                    [[label, round(b["alone_p50_ms"], 1), round(b["alone_p99_ms"], 1),
                      round(b["during_p50_ms"], 1), round(b["during_p99_ms"], 1),
                      round(b["during_max_ms"], 1), b["gaps_during"], round(b["ttft_ms"])]
                     for label, b in ((k, r["beside"]) for k, r in results.items())]))
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens, "threads": args.threads}
    (OUT / "serve_burst.json").write_text(json.dumps({"args": meta, "results": results},
                                                     indent=1))
    plot_runs(results, OUT / "serve_burst.png", args.requests)
    print(f"wrote {OUT / 'serve_burst.json'}", flush=True)


def plot_runs(results: dict, path: Path, n: int) -> None:
    """Per engine setting: tokens/s of both phases (left), the burst's ITL p50/p99 and a lone
    stream's ITL p50 (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    x = range(len(labels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, phase in enumerate(("sequential", "burst")):
        left.bar([i + 0.4 * k for i in x], [results[lb][phase]["tok_s"] for lb in labels],
                 0.4, label=phase)
    left.set(ylabel="generated tokens/s", title=f"{n} requests: one after another vs at once")
    for k, (phase, key, name) in enumerate((("sequential", "itl_p50_ms", "lone stream ITL p50"),
                                            ("burst", "itl_p50_ms", "burst ITL p50"),
                                            ("burst", "itl_p99_ms", "burst ITL p99"))):
        right.bar([i + 0.27 * k for i in x], [results[lb][phase][key] for lb in labels], 0.27,
                  label=name)
    right.set(ylabel="ms", title="inter-token latency")
    for ax in (left, right):
        ax.set_xticks([i + 0.2 for i in x], labels, fontsize=7, rotation=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
