"""bench/kernels/bandwidth.py --smoke runs end to end on CPU (Triton under its interpreter): every row
kind the GPU run prints, the JSON and the plot. Its figures
are not speeds (the interpreter); this checks the script a GPU run depends on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, scripts/gpu_check.sh runs the real bench")
@pytest.mark.timeout(600)
def test_kernels_bench_smoke_writes_every_row():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("KVMESH_KERNELS", None)
    run = subprocess.run([sys.executable, "-m", "bench.kernels.bandwidth", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((ROOT / "bench/out/kernels_smoke.json").read_text())
    kinds = {r["case"].split()[0] for r in report["rows"]}
    assert kinds == {"mxfp8_quant", "moe_grouped"}
    assert all(r["gbs"] > 0 and r["torch_us"] > 0 for r in report["rows"])
    assert (ROOT / "bench/out/kernels_smoke_moe.png").stat().st_size > 1000
