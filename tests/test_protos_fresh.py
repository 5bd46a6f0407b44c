"""Generated protobuf code must match what `make protos` produces from protos/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_protos.py"), str(tmp_path)], check=True,
                   capture_output=True)
    fresh = sorted((tmp_path / "kvmesh/proto").glob("*_pb2*.py*"))
    assert fresh, "no generated files"
    committed = {p.name for p in (ROOT / "kvmesh/proto").glob("*_pb2*.py*")}
    assert committed == {p.name for p in fresh}, "generated file set differs: run `make protos`"
    for f in fresh:
        assert f.read_bytes() == (ROOT / "kvmesh/proto" / f.name).read_bytes(), (
            f"kvmesh/proto/{f.name} is stale: run `make protos`"
        )
