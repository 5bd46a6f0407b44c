"""Per-prompt results of the replay-quality benchmark (bench/quality/replay_v41.py): kept one JSON line per prompt as each group of prompts
finishes, so a stopped run resumes where it was and a partial run can be reported."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from bench.quality.forcing import aggregate


def load_records(path: Path) -> dict[int, dict]:
    """Per-prompt records of earlier runs (a line cut short by a killed run is skipped)."""
    done: dict[int, dict] = {}
    for line in path.open() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[r["i"]] = {**done.get(r["i"], {}), **r}
    return done


def run_prompts(a, path: Path, length: int, wanted: set[int],
                rows: Callable[[], list[list[int]]], singles: Callable[[], object],
                continuation: int) -> dict[int, dict]:
    """The records of a.prompts prompts of `length` tokens at `path`: those there, and the
    ones still missing a wanted variant, run in groups of a.group by `singles()`'s `group`
    (items (i, prompt, continuation) -> records) and appended as each group ends. `rows()`
    gives every prompt + continuation; a.fresh starts over, a.merge_only runs nothing,
    a.shard = (k, n) takes every n-th prompt still to do from the k-th."""
    if a.fresh and path.exists():
        path.unlink()
    done = load_records(path)
    # strided, so that a partial run (stopped, then merged) spans the whole held-out stream
    order = sorted(range(a.prompts), key=lambda i: (i % 10, i))
    todo = [i for i in order if i not in done or any(f"v{v}" not in done[i] for v in wanted)]
    k0, n_shards = getattr(a, "shard", (0, 1))
    todo = todo[k0::n_shards]
    if not todo or a.merge_only:
        return done
    texts, runner, t0 = rows(), singles(), time.perf_counter()
    print(f"L={length}: {len(done)} of {a.prompts} prompts already in {path.name}, "
          f"{len(todo)} to run in groups of {a.group}", flush=True)
    for k in range(0, len(todo), a.group):
        idx = todo[k: k + a.group]
        recs = runner.group([(i, texts[i][:length], texts[i][length:length + continuation])
                             for i in idx])
        with path.open("a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
                done[r["i"]] = {**done.get(r["i"], {}), **r}
        el, n = time.perf_counter() - t0, k + len(idx)
        print(f"L={length}: {n}/{len(todo)} prompts, {el:.0f} s, {el / n:.1f} s/prompt, "
              f"ETA {el / n * (len(todo) - n):.0f} s", flush=True)
    return done


def summaries(done: dict[int, dict], wanted: set[int], names: dict[int, str],
              length: int) -> dict[str, dict]:
    """Each wanted variant's aggregate over the prompts that have it."""
    out = {}
    for v in sorted(wanted):
        recs = [done[i][f"v{v}"] for i in sorted(done) if f"v{v}" in done[i]]
        if recs:
            out[f"{names[v]}, L={length}"] = aggregate(recs)
    return out
