"""bench/ is a package of modules run with `python -m bench.<subject>.<name>`: every benchmark's
--help shows each option's default (bench/common.parser), no module edits sys.path, a
benchmark (a module with a __main__ block) imports only library modules, never another
benchmark, no module assigns another object's private attributes, and every module imports."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from bench.common import parser

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (ROOT / "bench").rglob("*.py") if "out" not in p.parts)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _is_benchmark(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def _bench_imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("bench")}
    return out


def test_every_bench_builds_its_parser_with_defaults_shown():
    benchmarks = [p for p in MODULES if _is_benchmark(ast.parse(p.read_text()))]
    with_flags = [p for p in benchmarks if "add_argument(" in p.read_text()]
    assert len(with_flags) >= 15
    for p in with_flags:
        text = p.read_text()
        assert "argparse.ArgumentParser(" not in text, f"{p.name}: use bench.common.parser"
        assert re.search(r"\bparser\(", text), p.name


def test_bench_modules_run_as_modules_and_import_only_libraries():
    trees = {_name(p): ast.parse(p.read_text()) for p in MODULES}
    benchmarks = {name for name, tree in trees.items() if _is_benchmark(tree)}
    assert {"bench.engine.serve_burst", "bench.quality.replay_v41", "bench.kvstore.throughput",
            "bench.gateway.soak", "bench.kernels.bandwidth"} <= benchmarks
    for name, tree in trees.items():
        assert "sys.path" not in ast.unparse(tree), f"{name} edits sys.path"
        imported = _bench_imports(tree) & benchmarks
        assert not imported, f"{name} imports the benchmark(s) {sorted(imported)}"
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                for a in ast.walk(t):
                    if isinstance(a, ast.Attribute) and a.attr.startswith("_") \
                            and not (isinstance(a.value, ast.Name) and a.value.id in ("self", "cls")):
                        raise AssertionError(f"{name} sets {ast.unparse(a)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                raise AssertionError(f"{name} calls setattr")


def test_every_bench_module_imports():
    for p in MODULES:
        importlib.import_module(_name(p))


def test_the_shared_parser_prints_defaults_and_keeps_the_description():
    ap = parser("line one\n  indented line two")
    ap.add_argument("--rounds", type=int, default=30, help="how many")
    ap.add_argument("--mode", default="fast")
    text = ap.format_help()
    assert "how many (default: 30)" in text and "(default: fast)" in text
    assert "  indented line two" in text
