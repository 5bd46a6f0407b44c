"""bench/quality/forcing.py reads a teacher-forced continuation from ONE prefill of
prompt + continuation (truncation point and prefix match pinned to the prompt alone).
Pinned here in float64 against two independent computations: the plain reference with the
prompt's truncation point, and a request of the prompt alone whose decode steps are forced
to the same tokens (cold, snapshot hit and bounded replay hit)."""

import pytest
import torch

from bench.quality.forcing import ForcingEngine, Req, forced, run, warm
from services.engine.config import TINY, EngineConfig
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model import reference
from services.engine.model import weights as weights_mod
from tests.engine.helpers import random_prompt

EXACT = 1e-9
KEEP = 134
L, N = 600, 20
WEIGHTS = weights_mod.init_weights(TINY, 0, torch.float64)


def ecfg(policy="full"):
    return EngineConfig(dtype="float64", num_slots=4, max_running=4, num_blocks=64,
                        max_batched_tokens=4 * 32 + 1, long_prefill_chunk=32,
                        truncation="compact", keep_tokens=KEEP, swa_policy=policy)


class DecodeForcing(EngineCore):
    """The plain way: decode step by step, each sample replaced by the next forced token."""

    def __init__(self, *a, want=(), **kw):
        super().__init__(*a, **kw)
        self.want, self.rows = list(want), []

    def _emit(self, seq, logits, *args, token=None, **kw):
        self.rows.append(logits.clone())
        return super()._emit(seq, logits, *args, token=self.want[len(seq.output)], **kw)


def decode_forced(prompt, cont, policy, warm_to=None):
    eng = DecodeForcing(TINY, ecfg(policy), weights=WEIGHTS, want=cont)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if warm_to:
        eng.add_request(prompt[:warm_to], params, salt="s")
        while eng.has_work:
            eng.step()
        eng.rows.clear()
    seq = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=len(cont), ignore_eos=True),
                          salt="s")
    while eng.has_work:
        eng.step()
    return torch.stack(eng.rows), seq


def test_forced_prefill_rows_equal_the_reference_with_the_prompts_truncation_point():
    tokens = random_prompt(L + N, 7)
    eng = ForcingEngine(TINY, ecfg(), weights=WEIGHTS)
    got = run(eng, [forced("a", tokens[:L], tokens[L:], "s")])["a"]
    dec_lo = L - KEEP
    ref = reference.forward(WEIGHTS, TINY, tokens, dec_lo=dec_lo, dec_mode="compact")
    want = ref.logits[L - 1 - dec_lo: L - 1 - dec_lo + N]
    assert got.logits.shape == want.shape
    assert float((got.logits.double() - want).abs().max()) <= EXACT
    # the same rows in float64 from the engine's own decode path
    rows, _ = decode_forced(tokens[:L], tokens[L:], "full")
    assert float((got.logits.double() - rows).abs().max()) <= EXACT


@pytest.mark.parametrize("policy", ["full", "zero"])       # snapshot hit, bounded replay
def test_forced_prefill_on_a_hit_equals_decode_forcing_on_the_same_hit(policy):
    tokens = random_prompt(L + N, 11)
    l1 = (L - KEEP) // 128 * 128
    eng = ForcingEngine(TINY, ecfg(policy), weights=WEIGHTS)
    warm(eng, [("a", tokens[: l1 + 1], "s")])
    got = run(eng, [forced("a", tokens[:L], tokens[L:], "s"), Req("g", tokens[:L], "s", greedy=3)])
    rows, seq = decode_forced(tokens[:L], tokens[L:], policy, warm_to=l1 + 1)
    assert got["a"].cached == got["g"].cached == seq.cached_tokens == l1
    assert got["a"].replayed == seq.replayed_tokens == (128 if policy == "zero" else 0)
    assert float((got["a"].logits.double() - rows).abs().max()) <= EXACT
