"""bench/engine_step_costs.py runs every piece end to end: each stand-in still fits the
function it replaces (a runner or kernel signature change broke it once: a stand-in without
the new arguments raised TypeError mid-step). Its figures are timings; this checks the
script, not a speed."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.engine_step_costs import PIECES  # noqa: E402


def test_step_costs_bench_runs_every_piece():
    run = subprocess.run([sys.executable, "bench/engine_step_costs.py", "--batches", "1,2",
                          "--pairs", "2", "--steps", "1", "--prompt", "300"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cost = json.loads((ROOT / "bench/out/engine_step_costs.json").read_text())["cost_s"]
    assert set(cost) == set(PIECES)
    for piece, by_batch in cost.items():
        assert set(by_batch) == {"1", "2"}, piece
        for step_s, saved_s, err_s in by_batch.values():
            assert step_s > 0 and math.isfinite(saved_s) and err_s >= 0, piece
    assert (ROOT / "bench/out/engine_step_costs.png").stat().st_size > 1000


def test_step_costs_bench_refuses_one_pair():
    run = subprocess.run([sys.executable, "bench/engine_step_costs.py", "--pairs", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--pairs must be at least 2" in run.stderr
