"""Generate Python code for every proto under protos/ into kvmesh/proto/.

The one command that produces generated code (`make protos`). The files are
mapped to the virtual path kvmesh/proto/ so generated imports read
`from kvmesh.proto import engine_pb2` and work inside the package.
Usage: python scripts/gen_protos.py [OUT_DIR]   (OUT_DIR defaults to the repo root)
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_root: Path) -> list[Path]:
    protos = sorted((ROOT / "protos").glob("*.proto"))
    (out_root / "kvmesh" / "proto").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-Ikvmesh/proto={ROOT / 'protos'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
    ] + [f"kvmesh/proto/{p.name}" for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "kvmesh" / "proto").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for f in generate(out):
        print(f.relative_to(out))
