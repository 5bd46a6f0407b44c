"""Each field of the request record (Request) has one writer, Engine: a check over the
engine's source, so a new assignment from elsewhere fails here instead of the engine thread's
ownership drifting."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from kvmesh.services.engine.core.request import Request

ENGINE = Path(__file__).resolve().parents[3] / "services" / "engine"
WRITERS = {
    "core/engine.py": {"output", "finish", "seq", "registered", "snapshot_at", "replay",
                       "prefetched", "cached_tokens", "replayed_tokens", "cut",
                       "scheduled_s"},
}
# set at construction and never assigned again (`chain` grows in place through
# cachekeys.extend_chain, called by PrefixReuse on Engine's behalf)
FIXED = {"request_id", "prompt", "params", "seed", "salt", "traffic_class", "handoff", "chain"}
# same names on other objects: a GenerateRequest's `prompt` field
NOT_REQUESTS = {"rpc/client.py": {"prompt"}}
FIELDS = {f.name for f in dataclasses.fields(Request)}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear"}


def writes(tree: ast.AST) -> set[str]:
    """Request field names written through an attribute of something other than self."""
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


def test_every_request_field_is_written_only_by_its_owner():
    assert set().union(*WRITERS.values()) | FIXED == FIELDS
    found = {}
    for path in ENGINE.rglob("*.py"):
        rel = path.relative_to(ENGINE).as_posix()
        wrote = writes(ast.parse(path.read_text()))
        stray = wrote - WRITERS.get(rel, set()) - NOT_REQUESTS.get(rel, set())
        if stray:
            found[rel] = sorted(stray)
    assert found == {}


def test_the_check_sees_an_assignment():
    assert writes(ast.parse("req.cut = 3\nother.finish, x = 1, 2\nreq.output.append(1)"
                            "\ndel r.prompt[2:]")) == {"cut", "finish", "output", "prompt"}
