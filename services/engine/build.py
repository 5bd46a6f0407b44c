"""Build the engine core (Engine) from command-line options (shared by `serve`, `layout`
and `generate --local`).

Flags that size the cache default to None so that `EngineConfig.from_flags` can
tell "not given" (fall back to the KVMESH_* variable) from "given".
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.services.engine.config import (
    REPLAY_BLOCKS,
    ROLES,
    SPEC_POLICIES,
    TRUNCATION_MODES,
    EngineConfig,
)
from kvmesh.shipped import DEFAULT_MODEL

if TYPE_CHECKING:
    from kvmesh.services.engine.core.engine import Engine
# --step-slo-ms's default: a step that carries prefill work beside decodes is sized to finish
# within this many milliseconds (core/step_budget.py, docs/engine/scheduling.md), so a stream
# keeps getting a token about this often while new prompts are admitted beside it. 32
# requests at once over gRPC on the 2-core development machine (bench/engine/serve_burst.py): at 70
# ms, 5.5x the sequential run, 30 decoding together, ITL p99 78 ms = 4.5x a lone stream's
# p50; at 100 ms, 6.5x and 5.7x; off, 6.7x and 9.8x (a decode-only step of 32 there is
# already 3x a lone stream's).
STEP_SLO_MS = 70.0
# Requests an engine runs at once (slots and scheduled sequences): enough that a burst of
# this many decodes together. A slot costs what `kvmesh engine layout` prints (the shipped
# model: 127 KB; DeepSeek V4.1-Flash: 2.9 MB), so 32 are cheap beside the blocks.
MAX_RUNNING = 32


def add_engine_args(p: argparse.ArgumentParser, title: str = "model and cache"):
    """Adds the group of model and cache flags; returns it."""
    g = p.add_argument_group(title)
    g.add_argument("--model", default=None,
                   help="a DeepSeek V4 or V4.1 checkpoint directory (config.json, safetensors, "
                        "tokenizer.json; docs/deepseek-v4.md) (default: the shipped "
                        "models/deepseek-v41-tiny)")
    g.add_argument("--tokenizer", help="HuggingFace tokenizer.json (default: the checkpoint's)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="weights and activations (float64: the exactness tests)")
    g.add_argument("--device", default=None,
                   help="auto | cpu | cuda | cuda:N: where weights, state slots, blocks and the "
                        "forward live (env KVMESH_ENGINE_DEVICE; default auto, which is the CPU "
                        "for now: cuda must be asked for)")
    g.add_argument("--num-slots", type=int, default=MAX_RUNNING,
                   help="state slots: requests that can run at once")
    g.add_argument("--num-blocks", type=int, default=1024,
                   help="128-token cache blocks of compressed entries")
    g.add_argument("--max-batched-tokens", type=int, default=512,
                   help="tokens one engine step computes: decodes first, then prefill chunks")
    g.add_argument("--long-prefill-chunk", type=int, default=256,
                   help="most prompt tokens one sequence prefills per step (0: up to the "
                        "budget); bounds the inter-token latency of decodes beside a long prompt")
    g.add_argument("--step-slo-ms", type=float, default=None,
                   help="size the prefill work of a step that has decodes so that the step is "
                        "predicted (from a fit of measured step times) to finish within this "
                        "many milliseconds: the inter-token latency target while prompts are "
                        "admitted; 0: off (only --max-batched-tokens and --long-prefill-chunk); "
                        f"ignored with --deterministic (default {STEP_SLO_MS:g})")
    g.add_argument("--max-running", type=int, default=MAX_RUNNING,
                   help="sequences scheduled in one step")
    g.add_argument("--truncation", choices=TRUNCATION_MODES, default=None,
                   help="YOCO prefill truncation (env KVMESH_YOCO_PREFILL_TRUNCATION_MODE, default off)")
    g.add_argument("--keep-tokens", type=int, default=None,
                   help="KEEP, required with truncation (env KVMESH_YOCO_PREFILL_KEEP_TOKENS, "
                        "default none)")
    g.add_argument("--extra-state", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill-engine SWA ring of W + B + EXTRA (+ KEEP with truncation): 396 "
                        "(env KVMESH_PREFILL_STORE_EXTRA_STATE, default off)")
    g.add_argument("--extra-state-size", type=int, default=None,
                   help="EXTRA rows of the long ring (env KVMESH_PREFILL_STORE_EXTRA_SIZE, default 128)")
    g.add_argument("--max-backtrack", type=int, default=None,
                   help="B: tokens a sequence may take back (env KVMESH_MAX_BACKTRACKING_TOKENS, "
                        "default 6)")
    g.add_argument("--role", choices=ROLES, default="unified",
                   help="prefill/decode disaggregation: a prefill engine (extra-state on unless "
                        "--no-extra-state is given) hands each request to a decode engine after "
                        "its first token; a decode engine keeps the 134 ring")
    g.add_argument("--speculative", default="off",
                   help="speculative decoding: off | ngram:K (prompt lookup) | mtp:K (needs "
                        "an MTP module: DeepSeek V4's mtp.* tensors, or kvmesh's kvmesh.mtp.* "
                        "on V4.1), K <= B drafts per step; requests may ask for off or a "
                        "smaller K")
    g.add_argument("--spec-policy", choices=SPEC_POLICIES, default="adaptive",
                   help="adaptive: each step drafts only where the measured verify cost and the "
                        "acceptance seen so far promise more tokens per second than a plain step "
                        "(a request's K is an upper bound); always: every request drafts its K, "
                        "backing off after rejections. --deterministic implies always")
    g.add_argument("--ngram-min", type=int, default=1,
                   help="ngram drafter: shortest suffix it looks up")
    g.add_argument("--ngram-max", type=int, default=4,
                   help="ngram drafter: longest suffix it looks up (tried first)")
    g.add_argument("--deterministic", action="store_true",
                   help="refuse settings whose output may change under preemption "
                        "(truncation on)")
    g.add_argument("--swa-policy", default="full",
                   help="which 128-token boundaries keep an SWA snapshot: full | periodic:N | zero")
    g.add_argument("--replay-blocks", choices=REPLAY_BLOCKS, default="share",
                   help="blocks completed after a bounded replay: share them under the exact "
                        "prefix hash, or isolate them under a lineage-salted hash that exact "
                        "requests never match (README, 'Replay quality')")
    g.add_argument("--snapshot-mb", type=int, default=256,
                   help="host memory for SWA snapshots, MiB")
    g.add_argument("--snapshot-ttl-min", type=float, default=60.0,
                   help="minutes an unused snapshot is kept")
    return g


def step_slo_ms(args) -> float:
    """--step-slo-ms as given, else its default."""
    given = getattr(args, "step_slo_ms", None)
    return STEP_SLO_MS if given is None else given


def engine_config(args, env=None) -> EngineConfig:
    """Flags first; the KVMESH_* variables (env, default os.environ) only for flags not given."""
    role = getattr(args, "role", "unified")
    extra = args.extra_state
    if role == "prefill" and extra is None:
        extra = True                   # a prefill engine runs extra-state unless told otherwise
    return EngineConfig.from_flags(
        env,
        num_slots=args.num_slots, num_blocks=args.num_blocks,
        max_batched_tokens=args.max_batched_tokens, max_running=args.max_running,
        long_prefill_chunk=args.long_prefill_chunk,
        step_slo_ms=step_slo_ms(args),
        truncation=args.truncation, keep_tokens=args.keep_tokens, extra_state=extra, role=role,
        extra_state_size=args.extra_state_size, max_backtrack=args.max_backtrack,
        speculative=args.speculative, spec_policy=args.spec_policy, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        deterministic=args.deterministic, swa_policy=args.swa_policy,
        replay_blocks=args.replay_blocks,
        snapshot_bytes=args.snapshot_mb << 20, snapshot_ttl_min=args.snapshot_ttl_min,
        dtype=args.dtype, device=args.device,
    )


def choose_model(args) -> None:
    """Fill in the model the flags leave open: the shipped DeepSeek V4.1 model."""
    if args.model is None:
        if not (DEFAULT_MODEL / "config.json").exists():
            raise ValueError(f"the shipped model {DEFAULT_MODEL} is missing: pass --model DIR")
        args.model = str(DEFAULT_MODEL)


def build_core(args, split=None) -> Engine:
    """An Engine serving the DeepSeek V4 or V4.1 checkpoint in --model DIR (default the
    shipped model; by its config's model_type), with its tokenizer; given a split
    (parallel.Split, its process group started), over this rank's share of the model.
    torch is imported here, not at module import: `kvmesh --help` and the remote
    `kvmesh generate` stay fast."""
    import torch

    from kvmesh.checkpoint_dir import is_v41
    from kvmesh.services.engine.core.engine import Engine
    from kvmesh.services.engine.device import resolve
    from kvmesh.services.engine.model.deepseek_v4 import window_rows
    from kvmesh.services.engine.model.deepseek_v4.checkpoint import (
        load_checkpoint,
        load_v41_checkpoint,
    )
    from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
    from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model

    choose_model(args)
    # auto stays on the CPU until a GPU run has checked this path (docs/deployment/devices.md);
    # --device cuda asks for it
    device = resolve("cpu" if args.device in (None, "auto") else args.device)
    if split is not None and device.type != "cpu":
        raise ValueError(f"--device {args.device}: an engine split over ranks runs on the CPU "
                         "(gloo) for now")
    directory = Path(args.model)
    ecfg = engine_config(args)
    dtype = getattr(torch, ecfg.dtype)
    if split is not None:
        from kvmesh.services.engine.model.deepseek_v4.parallel import (
            Groups,
            ParallelV4Model,
            ParallelV41Model,
        )
    if is_v41(directory):
        cfg41, weights = load_v41_checkpoint(directory, dtype, split)
        weights = {k: t.to(device) for k, t in weights.items()}
        tokenizer = v4_tokenizer(directory, cfg41, args.tokenizer)
        rows41 = window_rows.for_dtype(dtype)
        model41 = V41Model(cfg41, weights, dtype, rows=rows41) if split is None else \
            ParallelV41Model(cfg41, weights, dtype, split, Groups(split), rows=rows41)
        return Engine(model41, ecfg, tokenizer, name=directory.resolve().name)
    cfg, weights = load_checkpoint(directory, dtype, split)
    weights = {k: t.to(device) for k, t in weights.items()}
    tokenizer = v4_tokenizer(directory, cfg, args.tokenizer)
    rows = window_rows.for_dtype(dtype)
    if split is None:
        model = V4Model(cfg, weights, dtype, stored=True, rows=rows)
    else:
        model = ParallelV4Model(cfg, weights, dtype, split, Groups(split), stored=True, rows=rows)
    return Engine(model, ecfg, tokenizer, name=directory.resolve().name)


def v4_tokenizer(directory: Path, cfg, path: str | None = None):
    """--tokenizer, else the checkpoint's tokenizer.json; its end token is the config's
    eos_token_id. ValueError when there is neither."""
    from kvmesh.tokenizer import HFTokenizer

    path = Path(path) if path else directory / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{path}: no such file (a DeepSeek V4 checkpoint directory needs its "
                         "tokenizer.json, or pass --tokenizer)")
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return HFTokenizer(path, eos_id=eos)
