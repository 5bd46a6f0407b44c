"""DeepSeek V4's engine: does it scale?

    1. prefill of a 1K / 2K / 4K-token prompt in 256-token chunks (seconds, ms per token):
       linear in the prompt (window + CSA top-k + HCA entries), or it is a bug;
    2. decode tokens/s of 1 and of 8 sequences after a 256-token prompt.

DeepSeek V4: random weights of a small config with V4-Flash's attention geometry (head_dim
512, window 128, CSA m = 4 with a 4 x 128 indexer, HCA m = 128, hyper-connections, routed
and hash MoE), served by Engine (core/engine.py: MXFP8 rings, fp32 tails and blocks,
float32).

    python -m bench.engine.deepseek_v4 [--lengths 1024,2048,4096] [--decode-steps 32]

Writes bench/out/deepseek_v4.{json,png}.
"""

from __future__ import annotations

import json
import sys

import torch

from bench.common import OUT, decode_tok_s, first_token_s, parser, plot, random_ids, table
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4 import names
from kvmesh.services.engine.model.deepseek_v4.config import config_from_dict
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.tokenizer import ByteTokenizer

CONFIG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
              head_dim=512, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=2,
              sliding_window=128, index_n_heads=4, index_head_dim=128, index_topk=512,
              num_hash_layers=1, layer_types=["sliding_attention", "compressed_sparse_attention",
                                              "heavily_compressed_attention",
                                              "compressed_sparse_attention"])
CHUNK = 256
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def v4_model() -> V4Model:
    cfg = config_from_dict(CONFIG)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in names.expected_shapes(cfg).items():
        if name.endswith("tid2eid"):
            weights[name] = torch.randint(0, cfg.n_experts, shape, generator=g)
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=g) * (0.15 if len(shape) < 2 else 0.03)
    return V4Model(cfg, weights, torch.float32, stored=True)


def v4_engine(model: V4Model, blocks: int) -> Engine:
    ecfg = EngineConfig(num_slots=8, num_blocks=blocks, max_batched_tokens=CHUNK,
                        long_prefill_chunk=CHUNK)
    return Engine(model, ecfg, ByteTokenizer(), "bench")


def v4_prefill(model: V4Model, length: int) -> float:
    """Seconds from the request to its first token (the prompt in CHUNK-token chunks)."""
    return first_token_s(v4_engine(model, length // 128 + 2),
                         random_ids(length, 1, model.cfg.vocab_size), GREEDY_ONE)


def v4_decode(model: V4Model, streams: int, steps: int) -> float:
    """Tokens/s of `streams` sequences decoding together after 256-token prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    return decode_tok_s(v4_engine(model, streams * 6),
                        [random_ids(256, 10 + k, model.cfg.vocab_size) for k in range(streams)],
                        params, steps)


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths to prefill")
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps per measurement")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = v4_model()
    out: dict = {"prefill_s": {"deepseek_v4": {}}, "decode_tok_s": {}}
    rows = []
    for n in lengths:
        a = v4_prefill(model, n)
        out["prefill_s"]["deepseek_v4"][n] = a
        rows.append([f"prefill {n}", a, a / n * 1e3])
        print(f"  prefill {n}: {a:.2f} s", flush=True)
    for streams in (1, 8):
        a = v4_decode(model, streams, args.decode_steps)
        out["decode_tok_s"][streams] = {"deepseek_v4": a}
        rows.append([f"decode x{streams} (tok/s)", a, float("nan")])
        print(f"  decode x{streams}: {a:.1f} tok/s", flush=True)
    print(table(["", "s | tok/s", "ms/token"], rows))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "deepseek_v4.json").write_text(json.dumps(out, indent=2))
    plot(OUT / "deepseek_v4.png", "prefill time (256-token chunks)", "prompt tokens", "seconds",
         {name: (lengths, [out["prefill_s"][name][n] for n in lengths])
          for name in ("deepseek_v4",)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
