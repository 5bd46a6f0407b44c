"""Small helpers shared by the benchmark scripts: tables, plots, process CPU time."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the repository
OUT = Path(__file__).resolve().parent / "out"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default (those without a help text too), and the
    description as written."""

    def _format_action(self, action):
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def parser(description: str) -> argparse.ArgumentParser:
    """Every benchmark's argument parser: its --help shows each option's default."""
    return argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached git worktree of `ref` (a commit, tag or branch of this repository), removed
    afterwards: how a bench sets an older tree's code beside this one's."""
    path = Path(tempfile.mkdtemp(prefix="kvmesh-worktree-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       check=False, capture_output=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank; nan for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c)
                                            for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
         logx: bool = True, logy: bool = True) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    import torch
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_token_s(core, prompt: list[int], params) -> float:
    """Seconds for `core` (an engine core, nothing running) to take `prompt` to its first
    token."""
    import time
    core.add_request(prompt, params)
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - t0


def decode_tok_s(core, prompts: list[list[int]], params, steps: int) -> float:
    """Tokens/s of the prompts' sequences decoding together, timed once every one has its
    first token (params.max_tokens = steps + 1)."""
    import time
    reqs = [core.add_request(p, params) for p in prompts]
    while any(not r.output for r in reqs):       # the prefills and their first tokens
        core.step()
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return len(prompts) * steps / (time.perf_counter() - t0)


def load_model(directory, dtype=None):
    """(model, tokenizer) of a DeepSeek V4.1 checkpoint directory (the shipped default's
    kind), as the engine loads them: V41Model in `dtype` (float32 by default), rounding its
    window rows as the engine's ledgers keep them."""
    import torch

    from kvmesh.services.engine.build import v4_tokenizer
    from kvmesh.services.engine.model.deepseek_v4 import window_rows
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
    from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model

    dtype = dtype or torch.float32
    cfg, weights = load_v41_checkpoint(directory, dtype)
    return (V41Model(cfg, weights, dtype, rows=window_rows.for_dtype(dtype)),
            v4_tokenizer(Path(directory), cfg))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n distinct prompts (no shared prefix block, so no prefix-cache hits between them)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def model_vocab(flags: list[str]) -> int:
    """Prompt ids drawn below the served model's vocabulary (the shipped default's unless
    --model is among the flags)."""
    import json

    from kvmesh.shipped import DEFAULT_MODEL
    model = Path(flags[flags.index("--model") + 1]) if "--model" in flags else DEFAULT_MODEL
    cfg = json.loads((model / "config.json").read_text())
    return cfg.get("text_config", cfg)["vocab_size"]
