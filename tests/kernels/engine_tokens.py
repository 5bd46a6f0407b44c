"""Greedy tokens of the engine on the shrunk test geometry, with the kernels that
KVMESH_KERNELS picks; run as a script in its own process (the Triton interpreter is
process-wide):

    TRITON_INTERPRET=1 KVMESH_KERNELS=triton python tests/kernels/engine_tokens.py 300

Two requests: a cold prompt, then one sharing its first blocks, so the second gets a
block-cache hit and (swa_policy zero: no snapshots) an encoder bounded replay and
decoder truncation. Prints one JSON line: tokens of both, and the hit / replay counts.
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


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)))
