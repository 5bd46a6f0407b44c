"""docs/usage/configuration.md says what the code does: it is what scripts/gen_config_doc.py
makes from the parsers and config classes (every flag of every `kvmesh` command with its
default), and every `KVMESH_*` variable the code reads is on it."""

from __future__ import annotations

import re
from pathlib import Path

from scripts import gen_config_doc

ROOT = Path(__file__).resolve().parents[1]


def test_the_page_is_what_the_code_says():
    assert gen_config_doc.main(["--check"]) == 0, \
        "docs/usage/configuration.md is stale: run python scripts/gen_config_doc.py"


def test_every_variable_the_code_reads_is_on_the_page():
    page = gen_config_doc.PAGE.read_text()
    listed = set(re.findall(r"^\| `(KVMESH_[A-Z0-9_]+)` \|", page, re.M))
    read = set()
    for part in ("launch", "training", "kvmesh", "services", "kernels", "bench"):
        for path in (ROOT / part).rglob("*.py"):
            read |= {n for n in re.findall(r"KVMESH_[A-Z0-9_]+", path.read_text())
                     if not n.endswith("_")}          # `KVMESH_GATEWAY_`: a prefix
    assert read, "the scan found no variable"
    assert not read - listed, f"read by the code, missing from the page: {sorted(read - listed)}"
