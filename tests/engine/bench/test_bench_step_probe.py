"""bench/step_probe.py runs end to end: its taps still find the step's rope_angles and weight
products (it stops with a message when the engine no longer calls them), and it writes every
figure it prints. Its figures are timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_step_probe_bench_measures_both_batches():
    run = subprocess.run([sys.executable, "bench/step_probe.py", "--batch", "2", "--rounds", "2",
                          "--steps", "1", "--prompt", "64", "--sweeps", "1,2", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((ROOT / "bench/out/step_probe.json").read_text())
    assert set(res["alone_s"]) == {"hot", "after 1 MB", "after 2 MB"}
    assert all(s > 0 for s in res["alone_s"].values())
    assert set(res["in_steps"]) == {"1", "2"}
    for got in res["in_steps"].values():
        assert got["probes"] >= 2                # a probe before each rope_angles of 2 rounds
        assert got["step"] > 0 and got["probe"] > 0 and got["mm"] > 0 and got["mm_warm"] > 0
    assert "waiting for memory" in run.stdout
    assert (ROOT / "bench/out/step_probe.png").stat().st_size > 1000


def test_step_probe_bench_refuses_one_round():
    run = subprocess.run([sys.executable, "bench/step_probe.py", "--rounds", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--rounds must be at least 2" in run.stderr
