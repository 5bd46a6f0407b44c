"""The design reference lives in this repository (docs/design.md) and everything cites it
by section: no file points outside the clone, and every `docs/design.md §N` names a section
that exists (a renumbering that would strand a citation fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SUFFIXES = {".py", ".md", ".proto", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".txt"}
NAMES = {"Makefile", "Dockerfile"}
SKIP_DIRS = {"proto", "out", "node_modules", "__pycache__"}   # generated code, bench output
# Built from pieces so that this file does not match itself.
OUTSIDE = ("../" + "shared", "DESIGN" + ".md")


def repo_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in SKIP_DIRS for p in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name in NAMES):
            yield path, rel


def design_sections() -> list[int]:
    text = DESIGN.read_text()
    heads = [int(n) for n in re.findall(r"^## §(\d+) ", text, re.M)]
    anchors = [int(n) for n in re.findall(r'^<a id="s(\d+)"></a>$', text, re.M)]
    assert heads == anchors, "every section needs its anchor, in order"
    return heads


def test_design_sections_are_numbered_in_order_with_anchors():
    heads = design_sections()
    assert heads == list(range(1, len(heads) + 1)) and len(heads) >= 10


def test_nothing_points_outside_the_repository():
    bad = [f"{rel}:{i}" for path, rel in repo_files()
           for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
           if any(o in line for o in OUTSIDE)]
    assert not bad, f"cite docs/design.md §N instead: {bad}"


def test_every_design_citation_names_an_existing_section():
    sections = set(design_sections())
    cited, bad = 0, []
    for path, rel in repo_files():
        if path == DESIGN:
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            at = line.find("design.md")
            if at < 0:
                continue
            for n in re.findall(r"§(\d+)", line[at:]):
                cited += 1
                if int(n) not in sections:
                    bad.append(f"{rel}:{i} §{n}")
    assert cited >= 5 and not bad, bad
