"""bench/engine/throughput.py runs end to end at a small size: every table, the JSON and the
plot, and its end-to-end and decode-only ratios taken per round (one request alone, then the
N together, back to back) with the median inside the rounds' range. Its figures are timings;
this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_throughput_bench_takes_its_ratios_per_round():
    run = subprocess.run([sys.executable, "-m", "bench.engine.throughput", "--prompt", "64", "--gen", "4",
                          "--steps", "2", "--rounds", "2", "--long", "256", "--itl-steps", "4",
                          "--itl-rounds", "1", "--label", "smoke"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((ROOT / "bench/out/engine_throughput_smoke.json").read_text())
    assert set(res["tput"]) == {"1", "8", "32", "64"}
    for n, t in res["tput"].items():
        assert t["rounds"] == 2, n
        for key in ("e2e_vs_seq", "dec_vs_1"):
            lo, hi = t[key + "_range"]
            assert 0 < lo <= t[key] <= hi, (n, key)
        assert 0 < t["prefill_share"] <= 1 and t["e2e_tok_s"] > 0 and t["seq_tok_s"] > 0, n
    assert "vs seq" in run.stdout and "range" in run.stdout and "inter-token latency" in run.stdout
    assert (ROOT / "bench/out/engine_throughput.png").stat().st_size > 1000
