"""bench/step_pieces.py runs end to end: two engines taking turns, every piece of a decode step
timed inside it, the pieces adding up to the step, and the plans timed alone. Its figures are
timings; this checks the script, not a speed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_step_pieces_bench_times_every_piece_of_a_decode_step():
    run = subprocess.run([sys.executable, "bench/step_pieces.py", "--batch", "4", "--rounds", "2",
                          "--steps", "1", "--prompt", "64"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((ROOT / "bench/out/step_pieces.json").read_text())
    for b in ("1", "4"):
        ms = got["ms"][b]
        pieces = [k for k in ms if k != "step"]
        assert len(pieces) == 11
        # every named piece ran in the step (the rests are differences and may be ~0)
        assert all(ms[k] > 0 for k in pieces if "rest" not in k), ms
        assert abs(sum(ms[k] for k in pieces) - ms["step"]) < 1e-6 * ms["step"] + 1e-9
        assert got["plans_alone_ms"][b] > 0
    assert "growth" in run.stdout and (ROOT / "bench/out/step_pieces.png").stat().st_size > 1000
