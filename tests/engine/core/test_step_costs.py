"""The latency-sized prefill cap (core/step_costs.py, --itl-ratio): the rule from injected
costs (no timing), the scheduler applying it to steps with decodes only, the engine reporting
each step's mix, and exactness unchanged under it."""

import pytest

from services.engine.config import EngineConfig, small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.core.step_costs import MIN_PREFILL, WINDOW, StepCosts
from tests.engine.core.test_equivalence import EXACT, max_logit_error
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()


def test_cap_follows_the_measured_costs():
    c = StepCosts(3.0)
    assert c.prefill_cap(4) is None                 # nothing measured yet: no cap
    c.observe(4, 0, 0.020)                          # a decode-only step: 20 ms
    assert c.prefill_cap(4) is None                 # no token cost yet
    c.observe(0, 100, 0.050)                        # prefill only: all 50 ms is the tokens'
    assert c.token_s == pytest.approx(0.0005)
    assert c.prefill_cap(4) == 80                   # (3 - 1) * 20 ms / 0.5 ms
    assert c.prefill_cap(0) is None                 # no decodes: nothing waits, no cap
    c.observe(4, 50, 0.020 + 50 * 0.001)            # beside decodes: the decodes' 20 ms off,
    assert c.token_s == pytest.approx(0.001)        # and from now on only such steps count
    assert c.prefill_cap(4) == 40
    c.observe(0, 100, 0.010)
    assert c.token_s == pytest.approx(0.001)
    for s in (0.030, 0.030):                        # decode steps got longer: the median moves
        c.observe(4, 0, s)
    assert c.decode_s == pytest.approx(0.030) and c.prefill_cap(4) == 40 * 30 // 20
    c.observe(4, 40, 5.0)                           # a stretched step: one sample of two
    assert c.token_s == pytest.approx((0.001 + (5.0 - 0.030) / 40) / 2)
    for _ in range(WINDOW):                         # a prompt whose tokens really cost that much
        c.observe(4, 40, 5.0)
    assert c.prefill_cap(4) == MIN_PREFILL          # never below the floor


def test_one_slow_step_is_outvoted():
    c = StepCosts(2.0)
    for _ in range(3):
        c.observe(8, 0, 0.030)
        c.observe(8, 60, 0.030 + 60 * 0.0005)
    assert c.prefill_cap(8) == 60
    c.observe(8, 60, 1.0)                           # the machine stalled once
    assert c.prefill_cap(8) == 60
    c.observe(8, 0, 0.5)
    assert c.prefill_cap(8) == 60


def test_off_and_invalid():
    off = StepCosts(0.0)
    off.observe(4, 0, 0.02)
    off.observe(0, 100, 0.05)
    assert off.prefill_cap(4) is None and off.decode_s is None
    for bad in (-1.0, 0.5, 1.0):
        with pytest.raises(ValueError, match="itl_ratio"):
            StepCosts(bad)
        with pytest.raises(ValueError, match="itl_ratio"):
            EngineConfig(itl_ratio=bad)


class FixedCosts(StepCosts):
    """Costs set by the test; the engine's real step times are recorded, not used."""

    def __init__(self, ratio, decode_s, token_s):
        super().__init__(ratio)
        self.fixed, self.seen = (decode_s, token_s), []

    decode_s = property(lambda self: self.fixed[0])
    token_s = property(lambda self: self.fixed[1])

    def observe(self, decode_rows, prefill_tokens, seconds):
        self.seen.append((decode_rows, prefill_tokens))


def test_scheduler_caps_prefill_beside_decodes_only():
    engine = make_engine(CFG, num_slots=8, max_batched_tokens=256, itl_ratio=3.0)
    costs = engine.scheduler.costs = FixedCosts(3.0, decode_s=0.010, token_s=0.001)   # cap 20
    decoders = [engine.add_request(random_prompt(60, 10 + i), SamplingParams(temperature=0, max_tokens=40))
                for i in range(3)]
    engine.step()                      # nothing decodes yet: the prompts go in at once
    assert costs.seen[-1] == (0, 180) and all(not s.prefilling for s in decoders)
    long_seq = engine.add_request(random_prompt(150, 9), SamplingParams(temperature=0, max_tokens=3))
    while long_seq.prefilling or long_seq.slot is None:
        engine.step()
        assert costs.seen[-1] == (3, 20) or costs.seen[-1] == (3, 150 % 20), costs.seen[-1]
    assert len(costs.seen) == 1 + 8   # ceil(150 / 20) steps beside the three decodes
    run_to_completion(engine)
    for seq in (long_seq, decoders[0]):
        assert max_logit_error(engine, CFG, seq) <= EXACT


def test_engine_reports_each_steps_mix_and_deterministic_mode_ignores_the_ratio():
    engine = make_engine(CFG, num_slots=4, max_batched_tokens=64, itl_ratio=2.0)
    costs = engine.scheduler.costs
    assert costs.active
    seq = engine.add_request(random_prompt(100, 3), SamplingParams(temperature=0, max_tokens=3))
    run_to_completion(engine)
    # real timings went in: a prefill-only step's tokens and a decode-only step both measured
    assert costs.token_s and costs.decode_s and seq.output
    det = make_engine(CFG, num_slots=4, itl_ratio=2.0, deterministic=True)
    assert not det.scheduler.costs.active
