"""Serving a DeepSeek V4 / V4.1 checkpoint (the shipped default) loads none of V4-mini's
remaining modules: they can be deleted (issue 40) without touching the V4 path. Checked in a fresh interpreter that builds the engine the
way `kvmesh engine serve` does and runs one request through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# V4-mini's modules still in the tree (its engine, scheduler and runner are gone; these
# remain for its training and go with it)
V4_MINI = [
    "services.engine.model.reference", "services.engine.model.weights",
    "services.engine.model.mtp", "services.engine.model.ops",
]

PROBE = """
import json, sys
from services.engine import build
from services.engine.core.sampling import SamplingParams
from services.engine.core.async_engine import AsyncEngine
from services.engine.rpc import remote, server, service
p = build.argparse.ArgumentParser()
build.add_engine_args(p)
core = build.build_core(p.parse_args([]))
req = core.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=2))
while core.has_work:
    core.step()
print(json.dumps({"engine": type(core).__name__, "tokens": len(req.output),
                  "modules": sorted(m for m in sys.modules if m.startswith("services."))}))
"""


def test_serving_the_default_model_loads_no_v4_mini_module():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["engine"] == "V4Engine" and seen["tokens"] == 2
    assert "services.engine.core.v4_engine" in seen["modules"]
    assert not set(V4_MINI) & set(seen["modules"]), sorted(set(V4_MINI) & set(seen["modules"]))
