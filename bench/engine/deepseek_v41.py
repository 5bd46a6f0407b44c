"""DeepSeek V4.1's engine: what prefill truncation saves, and decode, in one run.

    1. prefill of a 1K / 2K / 4K-token prompt in 256-token chunks, with the decoder on every
       position (`--truncation off`) and on the last 134 only (`compact`): seconds and the
       ratio. The decoder (the last KV source and the layers after it) is half of this
       model's layers, so compact approaches 2x as the prompt grows past 134 tokens;
    2. decode tokens/s of 1, 8 and 32 sequences after a 256-token prompt.

Random weights of a small config with V4.1-Flash's attention geometry (head_dim 512, window
128, ratio-2 and ratio-1 KV sources with consumers, index sources with and without keys, a
candidate source keeping 64 blocks of 8, index top-k 512, hyper-connections, score-routed
MoE), served by Engine over V4.1's ledgers (MXFP8 rings, fp32 tails and blocks, float32).

    python -m bench.engine.deepseek_v41 [--lengths 1024,2048,4096] [--decode-steps 32]

Writes bench/out/deepseek_v41.{json,png}.
"""

from __future__ import annotations

import json
import sys

import torch

from bench.common import OUT, decode_tok_s, first_token_s, parser, plot, random_ids, table
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4 import v41_names, window_rows
from kvmesh.services.engine.model.deepseek_v4.v41_config import v41_config_from_dict
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.tokenizer import ByteTokenizer

CONFIG = dict(model_type="deepseek_v41", vocab_size=1024, hidden_size=256, num_hidden_layers=6,
              num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, q_lora_rank=128,
              o_groups=2, o_lora_rank=128, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=128, hc_mult=2, sliding_window=128, index_n_heads=4,
              index_head_dim=128, index_topk=512, compress_ratios=[0, 2, 2, 1, 1, 1],
              kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
              candidate_source_layer_id=3, candidate_topk_blocks=64, candidate_block_size=8)
CHUNK = 256
KEEP = 134
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def v41_model() -> V41Model:
    cfg = v41_config_from_dict(CONFIG)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in v41_names.expected_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith("_scale"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=g) * (0.15 if len(shape) < 2 else 0.03)
    return V41Model(cfg, weights, torch.float32, rows=window_rows.for_dtype(torch.float32))


def engine(model: V41Model, blocks: int, truncation: str, slots: int = 8) -> Engine:
    ecfg = EngineConfig(num_slots=slots, max_running=slots, num_blocks=blocks,
                        max_batched_tokens=CHUNK,
                        long_prefill_chunk=CHUNK, truncation=truncation,
                        keep_tokens=KEEP if truncation != "off" else 0)
    return Engine(model, ecfg, ByteTokenizer(), "bench")


def prefill(model: V41Model, length: int, truncation: str) -> float:
    """Seconds from the request to its first token (the prompt in CHUNK-token chunks)."""
    return first_token_s(engine(model, length // 128 + 2, truncation),
                         random_ids(length, 1, model.cfg.vocab_size), GREEDY_ONE)


def decode(model: V41Model, streams: int, steps: int) -> float:
    """Tokens/s of `streams` sequences decoding together after 256-token prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    return decode_tok_s(engine(model, streams * 6, "off", slots=max(8, streams)),
                        [random_ids(256, 10 + k, model.cfg.vocab_size) for k in range(streams)],
                        params, steps)


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths to prefill")
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps per measurement")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = v41_model()
    out = {"prefill_s": {"off": {}, "compact": {}}, "decode_tok_s": {}}
    rows = []
    for n in lengths:
        off, compact = prefill(model, n, "off"), prefill(model, n, "compact")
        out["prefill_s"]["off"][n], out["prefill_s"]["compact"][n] = off, compact
        rows.append([f"prefill {n}", off, compact, off / compact])
        print(f"  prefill {n}: off {off:.2f} s, compact {compact:.2f} s", flush=True)
    for streams in (1, 8, 32):
        rate = decode(model, streams, args.decode_steps)
        out["decode_tok_s"][streams] = rate
        rows.append([f"decode x{streams} (tok/s)", rate, float("nan"), float("nan")])
        print(f"  decode x{streams}: {rate:.1f} tok/s", flush=True)
    print(table(["", "off s | tok/s", "compact s", "off / compact"], rows))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "deepseek_v41.json").write_text(json.dumps(out, indent=2))
    plot(OUT / "deepseek_v41.png", "DeepSeek V4.1 prefill (256-token chunks)", "prompt tokens",
         "seconds", {mode: (lengths, [out["prefill_s"][mode][n] for n in lengths])
                     for mode in ("off", "compact")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
