"""bench/step_ratio.py runs end to end: two engines in one process, rounds alternating, the
JSON and the plot. Its figures are timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_ratio_bench_writes_its_report():
    run = subprocess.run([sys.executable, "bench/step_ratio.py", "--runs", "1", "--rounds", "3",
                          "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (after,) = json.loads((ROOT / "bench/out/step_ratio.json").read_text())["after"]
    assert 0 < after["b1_ms"] and 0 < after["b32_ms"]
    assert after["q1"] <= after["ratio"] <= after["q3"]
    assert "batch 32 / batch 1" in run.stdout and (ROOT / "bench/out/step_ratio.png").stat().st_size > 1000
