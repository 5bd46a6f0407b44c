"""The architecture contracts in pyproject.toml ([tool.importlinter]) hold, and the check
catches each kind of break (a copy of the tree with one bad import added must fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint_imports(root: Path) -> tuple[int, str]:
    """Run import-linter on the packages under `root` (they come first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_import_contracts_hold():
    code, out = lint_imports(ROOT)
    assert code == 0, out
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out


# (file, line added, contract that must break)
BREAKS = [
    ("services/gateway/core.py", "import kvmesh.services.engine", "only the engine imports"),
    ("services/kvstore/gc.py", "import kvmesh.services.gateway.model",
     "gateway, kvstore and directory are independent"),
    ("kvmesh/run_ca.py", "import kvmesh.services.kvstore.keys", "layers: launchers over training"),
    ("services/engine/build.py", "import kvmesh.launch.backing.proc", "layers: launchers over training"),
    ("kernels/__init__.py", "import kvmesh.services.engine.device", "layers: launchers over training"),
    ("services/engine/config.py", "import kvmesh.training.bpe", "layers: launchers over training"),
    ("training/loop.py", "import kvmesh.launch.cli", "layers: launchers over training"),
    ("services/engine/core/engine.py", "import grpc", "engine core, cache and model import no"),
    ("services/engine/cache/prefetch.py", "import kvmesh.services.engine.core.finish", "engine layers"),
    ("services/engine/cache/block_pool.py", "import torch", "block accounting needs no torch"),
    ("services/gateway/router.py", "import grpc", "gateway routing and validation"),
    # the top-level folder's name (importable from a checkout) instead of the installed one
    ("services/engine/build.py", "from kernels import mxfp8", "kvmesh imports its parts by"),
    ("kvmesh/s3.py", "import services.kvstore.keys", "kvmesh imports its parts by"),
    # a shared module the layers contract does not name (exhaustive)
    ("kvmesh/new_helper.py", "import os", "layers: launchers over training"),
]


@pytest.mark.parametrize("path,line,contract", BREAKS, ids=[b[0] for b in BREAKS])
def test_a_forbidden_import_breaks_its_contract(tmp_path, path, line, contract):
    for pkg in ("launch", "training", "services", "kernels", "kvmesh"):
        # kvmesh/services (and the other three) stay links to the copied top-level folders
        shutil.copytree(ROOT / pkg, tmp_path / pkg, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}\n")
    code, out = lint_imports(tmp_path)
    assert code != 0, out
    (name,) = [c["name"] for c in CONTRACTS if c["name"].startswith(contract)]
    flat = " ".join(out.split())         # contract names wrap in the report
    assert f"{name} BROKEN" in flat and f"Contracts: {len(CONTRACTS) - 1} kept, 1 broken." in flat, out


def test_no_test_package_takes_the_name_of_a_package_it_tests():
    """tests/ has no __init__.py, so tests/X/ (with one) imports as the package `X`: named
    like a top-level package (tests/training once), it hides that package from the suite."""
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    clash = {p.name for p in (ROOT / "tests").iterdir() if (p / "__init__.py").exists()} & top
    assert not clash, f"tests/{sorted(clash)[0]}/ hides the package of that name"
    assert {"training", "services", "kvmesh", "bench"} <= top
