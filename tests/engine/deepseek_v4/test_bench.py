"""bench/engine/deepseek_v4.py runs end to end: its JSON and its plot. Its figures are
timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_deepseek_v4_bench_writes_its_report():
    run = subprocess.run([sys.executable, "-m", "bench.engine.deepseek_v4", "--lengths", "128,256",
                          "--decode-steps", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((ROOT / "bench/out/deepseek_v4.json").read_text())
    for model in ("deepseek_v4",):
        assert set(report["prefill_s"][model]) == {"128", "256"}
        assert all(v > 0 for v in report["prefill_s"][model].values())
        assert all(report["decode_tok_s"][k][model] > 0 for k in ("1", "8"))
    assert "decode x8" in run.stdout and (ROOT / "bench/out/deepseek_v4.png").stat().st_size > 1000
