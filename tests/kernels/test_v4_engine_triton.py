"""The shipped model's engine with its Triton kernels (the MoE experts' grouped products and
MXFP8 quantization of window rows; the interpreter on CPU) gives the torch path's greedy
tokens, with log-probabilities within float32 noise, and the Triton kernels really ran.

Interpreter mode is process-wide and fixed at import, so both runs are child processes
(tests/kernels/v4_engine_tokens.py). Minutes on CPU: marked `interpreter`, run by
`make test-interpreter` and .ci/run, not `make test`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(kernels: str) -> dict:
    env = dict(os.environ, KVMESH_KERNELS=kernels)
    if kernels == "triton":
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-m", "tests.kernels.v4_engine_tokens", "160", "6",
                          kernels], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1100)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.interpreter
@pytest.mark.timeout(1200)       # minutes of interpreter on a busy 2-core machine
def test_triton_engine_greedy_tokens_equal_torch():
    want, got = run("torch"), run("triton")
    assert want["calls"] == {"moe": 0, "mxfp8": 0}
    assert got["calls"]["moe"] > 0 and got["calls"]["mxfp8"] > 0
    assert len(want["tokens"]) == 6 and got["tokens"] == want["tokens"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst < 1e-3, worst
