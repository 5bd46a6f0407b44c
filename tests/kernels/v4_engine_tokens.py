"""Child process of test_v4_engine_triton.py: the shipped model's engine on one prompt, its
greedy tokens and their log-probabilities as JSON, and how often each Triton kernel ran.
KVMESH_KERNELS and TRITON_INTERPRET come from the environment (interpreter mode is fixed
when triton is first imported, so the Triton run needs a process of its own)."""

from __future__ import annotations

import json
import sys

from kvmesh.services.engine.core.sampling import SamplingParams
from tests.engine.engines import random_prompt, serve_core


def main(n_prompt: int, n_tokens: int, count_triton: bool) -> dict:
    calls = {"moe": 0, "mxfp8": 0}
    if count_triton:
        from kvmesh.kernels.triton import moe, mxfp8

        def counted(module, name, key):
            real = getattr(module, name)

            def wrapper(*a, **kw):
                calls[key] += 1
                return real(*a, **kw)
            setattr(module, name, wrapper)

        counted(moe, "grouped_linear", "moe")
        counted(mxfp8, "quantize", "mxfp8")
    core = serve_core("--num-blocks", "16")
    req = core.add_request(random_prompt(n_prompt, 5),
                           SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True,
                                          logprobs=1))
    logprobs = []
    while core.has_work:
        for ev in core.step():
            logprobs += [lp.logprob for lp in ev.logprobs or []]
    return {"tokens": req.output, "logprobs": logprobs, "calls": calls}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "triton")))
