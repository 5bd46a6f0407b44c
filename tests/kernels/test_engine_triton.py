"""The engine with every kernel on Triton (interpreter on CPU) gives the torch path's
greedy tokens: a 300-token cold request, then one with a block-cache hit and a bounded
replay (shrunk test geometry, fp32). The child counts the Triton ragged kernel calls, so
the test also shows the engine's attention really ran on Triton.

Interpreter mode is process-wide and fixed at import, so the Triton run happens in a
child process (tests/kernels/engine_tokens.py); the torch run happens here. Minutes on
CPU: marked `interpreter`, run by `make test-interpreter` and .ci/run, not `make test`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import engine_tokens

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter
@pytest.mark.timeout(1200)       # minutes of interpreter on a busy 2-core machine
def test_triton_engine_greedy_tokens_equal_torch(monkeypatch):
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    want = engine_tokens.main(300)
    assert want["hit"]["cached"] > 0 and want["hit"]["replayed"] > 0   # the case we mean
    env = dict(os.environ, TRITON_INTERPRET="1", KVMESH_KERNELS="triton",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(ROOT / "tests/kernels/engine_tokens.py"), "300",
                          "--count"], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    calls, got = json.loads(lines[-2]), json.loads(lines[-1])
    assert got == want
    # the Triton ragged kernels were on the path: every layer of every step attends through
    # them (decode rows reading the MXFP8 ring bytes in place), CSA rows score through Triton
    assert calls["ragged_attention"] > 100 and calls["ring_mxfp8"] > 10, calls
    assert calls["indexer"] > 0, calls
