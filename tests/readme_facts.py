"""What the README and the user docs promise about metrics, read from them, so that a new
metric named there is checked by the tests without anyone editing them.

    readme()                 README.md and every user doc (docs/usage, deployment, engine, lab,
                             metrics.md, kvstore.md, directory.md, tests.md) as one text
    metric_names(text)       every `kvmesh_...` metric they mention; a name ending
                             in `_*` or `_<name>` (`kvmesh_kvstore_gc_*`) is a prefix
    token_kinds(text)        the kinds listed in `kvmesh_tokens_total{...kind=a|b|c}`
    engine_counters(text)    the names listed under "## Engine counters"
    scrape(url)              samples of a live /metrics page: {(name, labels): value}
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def user_docs() -> list[Path]:
    pages = [README, DOCS / "metrics.md", DOCS / "kvstore.md", DOCS / "directory.md",
             DOCS / "tests.md"]
    for part in ("usage", "deployment", "engine", "lab"):
        pages += sorted((DOCS / part).glob("*.md"))
    return pages


def readme() -> str:
    return "\n\n".join(p.read_text() for p in user_docs())


def metric_names(text: str) -> set[str]:
    # lower case only: KVMESH_* are environment variables, not metrics. A placeholder
    # (`kvmesh_engine_<name>`) is a prefix, as `kvmesh_kvstore_gc_*` is.
    found = re.findall(r"\bkvmesh_[a-z][a-z0-9_]*(?:\*|<\w+>)?", text)
    return {re.sub(r"<\w+>$", "*", n) for n in found}


def token_kinds(text: str) -> set[str]:
    found = re.findall(r"kvmesh_tokens_total\{[^}]*kind=([a-z|]+)", text)
    return {k for group in found for k in group.split("|")}


def engine_counters(text: str) -> list[str]:
    section = re.split(r"\n#{1,2} ", text.split("## Engine counters", 1)[1], maxsplit=1)[0]
    return list(dict.fromkeys(re.findall(r"`([a-z_]+)`", section)))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def exported(samples: Samples, name: str) -> bool:
    """True if `name` (or, ending in `*`, a name with that prefix) has at least one sample.
    A histogram counts by its `_bucket`/`_count`/`_sum` samples, a counter exported from a
    stat (`kvmesh_engine_<name>`) by its `_total` one."""
    names = {n for n, _ in samples}
    if name.endswith("*"):
        return any(n.startswith(name[:-1]) for n in names)
    return any(n in (name, f"{name}_bucket", f"{name}_count", f"{name}_total") for n in names)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
