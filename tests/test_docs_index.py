"""The README is the way in: every page under docs/ is linked from it, every link it has
points at a file that exists, and every page opens with its title and one sentence saying
what it covers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _links(path: Path) -> set[Path]:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    return {(path.parent / t).resolve() for t in targets if not t.startswith(("http:", "https:"))}


def test_every_docs_page_is_linked_from_the_readme():
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")}
    assert pages
    linked = _links(README)
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_link_in_the_readme_and_docs_resolves():
    for page in [README, *(ROOT / "docs").rglob("*.md")]:
        for target in _links(page):
            assert target.exists(), f"{page.relative_to(ROOT)} links {target} (missing)"


def test_every_docs_page_opens_with_a_title_and_a_sentence():
    for page in (ROOT / "docs").rglob("*.md"):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), page
        first = next(line for line in lines[1:] if line.strip())
        assert not first.startswith(("#", "|", "```", "-")), (page, first)


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 300


def test_lab_notes_stay_out_of_the_user_docs_and_the_code():
    """Per-run circumstances (how busy the machine was) belong in docs/lab."""
    phrases = ("load " + "average", "slow " + "spell")     # in pieces: this file does not match
    places = [README, *(ROOT / "docs" / d for d in ("usage", "deployment", "engine"))]
    files = [p for place in places for p in ([place] if place.is_file() else place.rglob("*.md"))]
    files += [p for p in ROOT.rglob("*.py")
              if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    found = [(str(p.relative_to(ROOT)), phrase) for p in files
             for phrase in phrases if phrase in p.read_text(errors="replace").lower()]
    assert not found, found
