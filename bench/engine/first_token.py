"""One Engine for a prompt of some length and the seconds to a request's first token: what
the replay TTFT and SWA fetch benches measure."""

from __future__ import annotations

import time

from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
KEEP = 134


def engine(model, tok, length: int, policy: str, truncation: str) -> Engine:
    """An engine with blocks for one `length`-token prompt and some to spare."""
    ecfg = EngineConfig(num_slots=2, num_blocks=length // 128 + 16, max_batched_tokens=512,
                        truncation=truncation, keep_tokens=KEEP, swa_policy=policy)
    return Engine(model, ecfg, tok, name="replay-ttft")


def ttft(core: Engine, prompt: list[int]) -> tuple[float, object]:
    """(seconds to the first token, the request) of `prompt` on an idle `core`."""
    req = core.add_request(prompt, ONE)
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - t0, req
