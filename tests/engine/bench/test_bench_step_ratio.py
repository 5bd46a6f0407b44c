"""bench/step_ratio.py runs end to end: two engines in one process, rounds alternating, the
JSON and the plot. Its figures are timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_step_ratio_bench_writes_its_report():
    run = subprocess.run([sys.executable, "bench/step_ratio.py", "--runs", "1", "--rounds", "3",
                          "--threads", "2", "--split"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (after,) = json.loads((ROOT / "bench/out/step_ratio.json").read_text())["after"]
    assert 0 < after["b1_ms"] and 0 < after["b32_ms"]
    assert after["q1"] <= after["ratio"] <= after["q3"]
    assert "batch 32 / batch 1" in run.stdout and (ROOT / "bench/out/step_ratio.png").stat().st_size > 1000
    # --split: each batch's one-thread time read as serial + parallel, beside the main timing
    for batch, name in (("1", "b1_ms"), ("32", "b32_ms")):
        sp = after["split"][batch]
        assert sp["tn_ms"] == after[name] and sp["t1_ms"] > 0
        assert abs(sp["serial_ms"] + sp["parallel_ms"] - sp["t1_ms"]) < 1e-9
        assert abs(sp["serial_ms"] + sp["parallel_ms"] / 2 - sp["tn_ms"]) < 1e-9
    assert "serial and parallel parts" in run.stdout


def test_split_needs_two_threads():
    run = subprocess.run([sys.executable, "bench/step_ratio.py", "--threads", "1", "--split"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--split compares one thread" in run.stderr
