"""bench/engine/deepseek_v41.py runs end to end: both truncation modes, decode, its JSON and its plot.
Its figures are timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_deepseek_v41_bench_writes_its_report():
    run = subprocess.run([sys.executable, "-m", "bench.engine.deepseek_v41", "--lengths", "256,384",
                          "--decode-steps", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((ROOT / "bench/out/deepseek_v41.json").read_text())
    for mode in ("off", "compact"):
        assert set(report["prefill_s"][mode]) == {"256", "384"}
        assert all(v > 0 for v in report["prefill_s"][mode].values())
    assert all(report["decode_tok_s"][k] > 0 for k in ("1", "8", "32"))
    assert "off / compact" in run.stdout and (ROOT / "bench/out/deepseek_v41.png").stat().st_size > 1000
