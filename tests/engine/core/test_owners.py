"""Each Sequence field has the one writer sequence.py names: a check over the engine's
source, so a new assignment from elsewhere fails here instead of drifting the docstring."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from services.engine.core.sequence import Sequence

ENGINE = Path(__file__).resolve().parents[3] / "services" / "engine"
WRITERS = {
    "cache/manager.py": {"prompt", "output", "slot", "table", "hashes", "num_computed",
                         "prefill_len", "enc_lo", "dec_lo", "cmp_from", "cached_tokens",
                         "replayed_tokens", "recomputed_tokens", "prefetched", "block_hashes",
                         "lineage"},
    "core/scheduler.py": {"status", "finish", "preemptions", "admitted_at", "scheduled_s"},
}
# same names on other objects: a GenerateRequest's `prompt` field, argparse args, and the
# DeepSeek V4 engine's own request record (V4Request, whose fields V4Engine alone writes)
NOT_SEQUENCES = {"rpc/client.py": {"prompt"}, "cli.py": {"prompt"},
                 "core/v4_engine.py": {"output", "finish", "cached_tokens", "replayed_tokens",
                                       "prefetched", "scheduled_s"}}
FIELDS = {f.name for f in dataclasses.fields(Sequence)}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear"}


def writes(tree: ast.AST) -> set[str]:
    """Sequence field names written through an attribute of something other than self."""
    out: set[str] = set()

    def target(node):
        if isinstance(node, ast.Attribute) and node.attr in FIELDS and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.add(node.attr)
        elif isinstance(node, ast.Subscript):
            target(node.value)
        elif isinstance(node, ast.Tuple):
            for elt in node.elts:
                target(elt)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            target(node.func.value)
    return out


def test_every_sequence_field_is_written_only_by_its_owner():
    assert set().union(*WRITERS.values()) | {"request_id", "params", "seed", "salt",
                                             "traffic_class", "handoff"} == FIELDS
    found = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ENGINE).as_posix()
        if rel == "core/sequence.py":
            continue
        wrote = writes(ast.parse(path.read_text()))
        stray = wrote - WRITERS.get(rel, set()) - NOT_SEQUENCES.get(rel, set())
        if stray:
            found[rel] = sorted(stray)
    assert found == {}


def test_the_check_sees_an_assignment():
    assert writes(ast.parse("seq.num_computed = 3\nvictim.status, x = 1, 2\nseq.output.append(1)"
                            "\ndel s.table[2:]")) == {"num_computed", "status", "output", "table"}
