"""Run benchmarks of this checkout and of an older one in one run, alternating, side by side.

For scripts that print their measurements as `name 1.234s` after a `L=<n>` label (the replay
TTFT and YOCO prefill benchmarks do), this runs each script `--rounds` times per checkout,
before and after taking turns so that drift in the machine's load hits both alike, keeps the
best (smallest) time of every (L, name) per checkout, and prints them with after / before.

    python bench/before_after.py --before /old/checkout \\
        "replay_ttft.py --lengths 1024,4096 --random-weights" \\
        "yoco_prefill.py --lengths 2048,8192 --random-weights"

Each script runs as it ships in its own checkout (`DIR/bench/<script>`, PYTHONPATH=DIR), so
the old numbers are the old code's. Writes bench/out/before_after.{json,png}.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT, parser, plot, table  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
LABEL = re.compile(r"L=(\d+)")
VALUE = re.compile(r"([A-Za-z_]+) ([0-9.]+)s\b")


def measure(checkout: Path, script: str) -> dict[str, float]:
    """Run one script of one checkout -> {"L=<n> <name>": seconds}."""
    name, *args = shlex.split(script)
    proc = subprocess.run([sys.executable, str(checkout / "bench" / name), *args], cwd=checkout,
                          env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
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
    ap.add_argument("--before", required=True, help="the older checkout")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("scripts", nargs="+", help='"script.py args" (quoted), from bench/')
    args = ap.parse_args(argv)
    best: dict[str, dict[str, dict[str, float]]] = {}
    for script in args.scripts:
        best[script] = {"before": {}, "after": {}}
        for r in range(args.rounds):
            for side, checkout in (("before", Path(args.before).resolve()), ("after", HERE)):
                print(f"{script} round {r + 1}: {side}", flush=True)
                for k, v in measure(checkout, script).items():
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
