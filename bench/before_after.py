"""Run benchmarks of this tree and of an older commit in one run, alternating, side by side.

For benchmarks that print their measurements as `name 1.234s` after a `L=<n>` label (the replay
TTFT benchmark does), this runs each module `--rounds` times per tree, before
and after taking turns so that drift in the machine's load hits both alike, keeps the best
(smallest) time of every (L, name) per tree, and prints them with after / before.

    python -m bench.before_after --before <commit> \\
        "bench.engine.replay_ttft --lengths 1024,4096"

The older commit is checked out in a git worktree and each module runs there as that commit
ships it (cwd and PYTHONPATH the worktree), so the old numbers are the old code's. Writes
bench/out/before_after.{json,png}.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench.common import OUT, ROOT, parser, plot, table, worktree

LABEL = re.compile(r"L=(\d+)")
VALUE = re.compile(r"([A-Za-z_]+) ([0-9.]+)s\b")


def measure(tree: Path, command: str) -> dict[str, float]:
    """Run one bench module in one tree -> {"L=<n> <name>": seconds}."""
    proc = subprocess.run([sys.executable, "-m", *shlex.split(command)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True, check=True)
    out, label = {}, ""
    for line in proc.stdout.splitlines():
        if m := LABEL.search(line):
            label = m.group(0)
        for key, value in VALUE.findall(line):
            out[f"{label} {key}".strip()] = float(value)
    return out


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the older commit (any git ref)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("modules", nargs="+", help='"bench.x.y args" (quoted)')
    args = ap.parse_args(argv)
    best: dict[str, dict[str, dict[str, float]]] = {}
    with worktree(args.before) as before:
        for script in args.modules:
            best[script] = {"before": {}, "after": {}}
            for r in range(args.rounds):
                for side, tree in (("before", before), ("after", ROOT)):
                    print(f"{script} round {r + 1}: {side}", flush=True)
                    for k, v in measure(tree, script).items():
                        best[script][side][k] = min(v, best[script][side].get(k, v))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "before_after.json").write_text(json.dumps(best, indent=1))
    series = {}
    for script, sides in best.items():
        rows = [[k, sides["before"][k], sides["after"][k], sides["after"][k] / sides["before"][k]]
                for k in sides["before"] if k in sides["after"]]
        print(f"\n{script} (seconds, best of {args.rounds} rounds; after/before < 1: faster)")
        print(table(["measurement", "before s", "after s", "after/before"], rows))
        series[script.split()[0]] = (list(range(len(rows))), [r[3] for r in rows])
    path = plot(OUT / "before_after.png", "after / before per measurement", "measurement #",
                "after / before", series)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
