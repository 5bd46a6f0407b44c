"""Greedy tokens of the engine on the shrunk test geometry, with the kernels that
KVMESH_KERNELS picks; run as a script in its own process (the Triton interpreter is
process-wide):

    TRITON_INTERPRET=1 KVMESH_KERNELS=triton python tests/kernels/engine_tokens.py 300 --count

Two requests: a cold prompt, then one sharing its first blocks, so the second gets a
block-cache hit and (swa_policy zero: no snapshots) an encoder bounded replay and
decoder truncation. Prints one JSON line: tokens of both, and the hit / replay counts;
with --count, a line before it with the calls of the Triton ragged kernels.
"""

from __future__ import annotations

import json
import sys

import torch

from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion


def main(length: int, new_tokens: int = 6) -> dict:
    torch.set_num_threads(1)
    cfg = small_test_config()
    engine = make_engine(cfg, dtype="float32", truncation="compact", keep_tokens=22,
                         swa_policy="zero", max_batched_tokens=128)
    first = random_prompt(length, 21)
    shared = (length // 2 // cfg.block_size) * cfg.block_size
    second = first[:shared] + random_prompt(length - shared, 22)
    out = {}
    for name, prompt in (("cold", first), ("hit", second)):
        seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens))
        run_to_completion(engine, check=False)
        out[name] = {"tokens": seq.output, "cached": seq.cached_tokens,
                     "replayed": seq.replayed_tokens}
    return out


def count_triton_calls() -> dict:
    """Wrap the Triton ragged kernels so the run can show they were on the engine's path:
    calls of the ragged attention, those reading MXFP8 ring bytes in place, and of the
    per-row indexer scores (filled in as the engine runs)."""
    from kernels import ragged
    from kernels.triton import indexer as tri_idx
    from kernels.triton import ragged as tri

    calls = {"ragged_attention": 0, "ring_mxfp8": 0, "indexer": 0}
    attention, scores = tri.union_attention, tri_idx.indexer_scores

    def counted_attention(q, groups, sink, scale):
        calls["ragged_attention"] += 1
        calls["ring_mxfp8"] += any(isinstance(g, ragged.RingKeys) and g.codes is not None
                                   for g in groups)
        return attention(q, groups, sink, scale)

    def counted_scores(q, w, k):
        calls["indexer"] += 1
        return scores(q, w, k)

    tri.union_attention, tri_idx.indexer_scores = counted_attention, counted_scores
    return calls


if __name__ == "__main__":
    calls = count_triton_calls() if sys.argv[2:] == ["--count"] else None
    out = main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
    if calls is not None:
        print(json.dumps(calls))
    print(json.dumps(out))
