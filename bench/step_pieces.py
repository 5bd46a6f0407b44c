"""Where a batch-32 decode step outgrows batch 1's, piece by piece, timed inside the step (issue 11).

Two engines in one process (tiny preset, fp32, 256-token prompts, every sequence decoding), one
with 1 sequence and one with `--batch`, take turns: each round times a block of steps of each.
Every call of the pieces below is timed by the wall clock where it runs; a piece's time a step
is its median over rounds (the two rests are taken from the medians, so the pieces add up to
the step's median), and growth is the larger batch's time less batch 1's:

    schedule       Scheduler.schedule
    works          EngineCore._work (a Work per sequence)
    build          StepBatch.build (the works' rows, slots and tables as index tensors)
    plans          ModelRunner._prepare (window, compressor and logit-row plans)
    layers         ModelRunner._layer, every layer (products, attention, feeding, ring writes)
    logits         ops.logits
    forward, rest  the rest of ModelRunner.forward (token list, embedding, mirror, results)
    commit         EngineCore._after_forward
    sampling       draw_batch and read_ids (the step's one host read)
    emit           EngineCore._emit (tokens to text, stop rules, events)
    step, rest     the rest of EngineCore.step (its loops over the plan and the results)

A timer costs ~0.3 us a call, and works, commit and emit are called once a sequence. Then the
index plans (build + plans) of one decode step of each batch are timed alone, as the best of
repeated calls: what they cost with their code and data hot, beside what they cost in the step.

    python bench/step_pieces.py [--batch 32] [--rounds 30] [--steps 6] [--threads 2]

Writes bench/out/step_pieces.{json,png}.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, plot, table  # noqa: E402
from bench.step_probe import batch_args, decoding  # noqa: E402
from services.engine.core import engine as engine_mod  # noqa: E402
from services.engine.core.engine import EngineCore  # noqa: E402
from services.engine.core.scheduler import Scheduler  # noqa: E402
from services.engine.model import ops  # noqa: E402
from services.engine.model.batch import StepBatch  # noqa: E402
from services.engine.model.runner import ModelRunner  # noqa: E402

# (label, owner, attribute): the forward's pieces first, then the step's around it
FORWARD = (("build", StepBatch, "build"), ("plans", ModelRunner, "_prepare"),
           ("layers", ModelRunner, "_layer"), ("logits", ops, "logits"))
AROUND = (("schedule", Scheduler, "schedule"), ("works", EngineCore, "_work"),
          ("commit", EngineCore, "_after_forward"), ("sampling", engine_mod, "draw_batch"),
          ("sampling", engine_mod, "read_ids"), ("emit", EngineCore, "_emit"))
AROUND_LABELS = {label for label, _, _ in AROUND}
ORDER = ("schedule", "works", "build", "plans", "layers", "logits", "forward, rest", "commit",
         "sampling", "emit", "step, rest")


class Clocks:
    """While entered, every piece (and the forward) adds its calls' seconds to `spent`."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Clocks:
        for label, owner, name in FORWARD + AROUND + (("forward", ModelRunner, "forward"),):
            raw = vars(owner)[name]
            static = isinstance(raw, staticmethod)
            self._saved.append((owner, name, raw))
            timed = self._timed(label, raw.__func__ if static else raw)
            setattr(owner, name, staticmethod(timed) if static else timed)
        return self

    def _timed(self, label: str, fn):
        spent = self.spent

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, raw in reversed(self._saved):
            setattr(owner, name, raw)
        self._saved.clear()


def in_steps(batches: list[int], prompt_len: int, rounds: int, steps: int
             ) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """(per batch and piece (ORDER, and 'step'): median seconds a step over rounds, per batch:
    the plans alone (plans_alone))."""
    cores = {b: decoding(b, prompt_len) for b in batches}
    got: dict[int, dict[str, list[float]]] = {b: defaultdict(list) for b in batches}
    with Clocks() as clocks:
        for _ in range(rounds):
            for b, core in cores.items():
                core.step()                     # the other engine's step just ran
                clocks.spent.clear()
                t0 = time.perf_counter()
                for _ in range(steps):
                    core.step()
                step = (time.perf_counter() - t0) / steps
                each = {k: v / steps for k, v in clocks.spent.items()}
                if set(each) != {label for label, _, _ in FORWARD} | AROUND_LABELS | {"forward"}:
                    raise SystemExit(f"a decode step no longer calls every piece (timed: "
                                     f"{sorted(each)}): this bench needs updating")
                for k, v in each.items():
                    got[b][k].append(v)
                got[b]["step"].append(step)
    out = {}
    for b, g in got.items():
        # medians of what was timed; the rests from those medians, so the table adds up
        med = {k: statistics.median(v) for k, v in g.items()}
        med["forward, rest"] = med["forward"] - sum(med[k] for k, _, _ in FORWARD)
        med["step, rest"] = med["step"] - med.pop("forward") - sum(med[k] for k in AROUND_LABELS)
        out[b] = med
    return out, plans_alone(cores)


def plans_alone(cores: dict[int, EngineCore], repeats: int = 300) -> dict[int, float]:
    """Per batch, seconds of build + plans for the works of that engine's next decode step,
    alone: the best of `repeats` calls, the batches taking turns call by call (hot)."""
    seen: dict[int, list] = {}
    forward = vars(ModelRunner)["forward"]

    def keeping(b: int):
        def kept(self, works):
            seen[b] = works
            return forward(self, works)
        return kept
    try:
        for b, core in cores.items():
            ModelRunner.forward = keeping(b)
            core.step()
    finally:
        ModelRunner.forward = forward
    best = dict.fromkeys(cores, float("inf"))
    for _ in range(repeats):
        for b, core in cores.items():
            runner, works = core.runner, seen[b]
            t0 = time.perf_counter()
            step = StepBatch.build(works, compact=runner.dec_mode == "compact",
                                   device=runner.device)
            runner._prepare(step, works, frozenset())
            best[b] = min(best[b], time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = batch_args(__doc__.splitlines()[0], steps=6)
    args = ap.parse_args(argv)
    if args.batch < 2 or args.rounds < 1 or args.steps < 1:
        ap.error("--batch must be at least 2, --rounds and --steps at least 1")
    torch.set_num_threads(args.threads)
    batches = [1, args.batch]
    got, alone = in_steps(batches, args.prompt, args.rounds, args.steps)
    one, big = got[1], got[args.batch]
    print(f"a decode step's pieces, ms a step (medians of {args.rounds} rounds of {args.steps} "
          f"steps, {args.threads} thread(s), wall clock)")
    print(table(["piece", "batch 1", f"batch {args.batch}", "growth"],
                [[k, one[k] * 1e3, big[k] * 1e3, (big[k] - one[k]) * 1e3]
                 for k in ORDER + ("step",)]))
    bookkeeping = [k for k in ORDER if k not in ("layers", "logits")]
    grow = sum(big[k] - one[k] for k in bookkeeping)
    print(f"\neverything but the layers and the logits grows {grow * 1e3:.3f} ms of "
          f"{(big['step'] - one['step']) * 1e3:.3f}; step {args.batch} / step 1 = "
          f"{big['step'] / one['step']:.3f}x, {(big['step'] - grow) / one['step']:.3f}x "
          "without that growth")
    print(f"build + plans of one decode step alone, hot: batch 1 {alone[1] * 1e3:.3f} ms, batch "
          f"{args.batch} {alone[args.batch] * 1e3:.3f} ms (in the step: "
          f"{(one['build'] + one['plans']) * 1e3:.3f} / {(big['build'] + big['plans']) * 1e3:.3f})")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "step_pieces.json").write_text(json.dumps(
        {"args": vars(args), "ms": {str(b): {k: got[b][k] * 1e3 for k in ORDER + ("step",)}
                                    for b in batches},
         "plans_alone_ms": {str(b): v * 1e3 for b, v in alone.items()}}, indent=1))
    path = plot(OUT / "step_pieces.png", "a decode step's pieces at batch 1 and batch "
                f"{args.batch}", "batch", "ms a step",
                {k: (batches, [got[b][k] * 1e3 for b in batches]) for k in ORDER}, logy=True)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
