"""Every benchmark's --help shows each option's default (bench/_common.parser)."""

from __future__ import annotations

import re
from pathlib import Path

from bench._common import parser

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_bench_builds_its_parser_with_defaults_shown():
    scripts = [p for p in BENCH.glob("*.py") if not p.name.startswith("_")]
    with_flags = [p for p in scripts if "add_argument(" in p.read_text()]
    assert len(with_flags) >= 15
    for p in with_flags:
        text = p.read_text()
        assert "argparse.ArgumentParser(" not in text, f"{p.name}: use bench._common.parser"
        assert re.search(r"\bparser\(", text), p.name


def test_the_shared_parser_prints_defaults_and_keeps_the_description():
    ap = parser("line one\n  indented line two")
    ap.add_argument("--rounds", type=int, default=30, help="how many")
    ap.add_argument("--mode", default="fast")
    text = ap.format_help()
    assert "how many (default: 30)" in text and "(default: fast)" in text
    assert "  indented line two" in text
