"""StepBudget (core/step_budget.py): the prefill cap that keeps a step with decodes within
--step-slo-ms, from a least-squares fit of step time on decode rows and prefill tokens; and
the schedulers of both engines holding to it."""

from __future__ import annotations

import random

import pytest

from kvmesh.services.engine.core.step_budget import MIN_PREFILL, MIN_STEPS, StepBudget


def _feed(budget, a, b, c, steps, noise=0.0, seed=0):
    rng = random.Random(seed)
    for _ in range(steps):
        rows, tokens = rng.randint(0, 32), rng.choice([0, 0, 64, 128, 256, 480])
        if rows or tokens:
            budget.observe(rows, tokens, (a + b * rows + c * tokens) * (1 + noise * rng.uniform(-1, 1)))


def test_the_fit_recovers_the_step_cost_and_caps_prefill_to_the_target():
    budget = StepBudget(100.0)
    _feed(budget, a=0.016, b=0.0009, c=0.0003, steps=40)
    a, b, c = budget.coefficients()
    assert a == pytest.approx(0.016, rel=1e-6) and b == pytest.approx(0.0009, rel=1e-6)
    assert c == pytest.approx(0.0003, rel=1e-6)
    # 100 ms - 16 ms - 30 rows x 0.9 ms = 57 ms of prefill at 0.3 ms a token
    assert budget.prefill_cap(30) == int((0.1 - 0.016 - 30 * 0.0009) / 0.0003) == 190
    assert budget.prefill_cap(1) > budget.prefill_cap(30)
    assert budget.prefill_cap(0) is None              # nothing decodes: nothing to protect


def test_noisy_steps_still_give_a_cap_near_the_true_one():
    budget = StepBudget(100.0)
    _feed(budget, a=0.016, b=0.0009, c=0.0003, steps=32, noise=0.2, seed=3)
    assert 140 <= budget.prefill_cap(30) <= 240


def test_decodes_alone_over_the_target_still_admit_the_minimum():
    budget = StepBudget(20.0)
    _feed(budget, a=0.016, b=0.0009, c=0.0003, steps=40)
    assert budget.prefill_cap(32) == MIN_PREFILL


def test_no_cap_until_the_fit_has_steps_and_prefill_to_go_on():
    budget = StepBudget(100.0)
    assert budget.prefill_cap(8) is None
    for rows in range(1, MIN_STEPS + 3):      # decode-only steps: the token cost is unknown
        budget.observe(rows, 0, 0.01 + 0.001 * rows)
    assert budget.prefill_cap(8) is None
    budget.observe(4, 256, 0.09)
    budget.observe(0, 128, 0.05)
    assert budget.prefill_cap(8) is not None


def test_off_and_bad_values():
    off = StepBudget(0.0)
    _feed(off, a=0.016, b=0.0009, c=0.0003, steps=40)
    assert not off.active and off.prefill_cap(8) is None
    with pytest.raises(ValueError, match="step_slo_ms"):
        StepBudget(-1.0)


def _engine(*flags):
    from tests.engine.engines import serve_core

    return serve_core("--num-slots", "4", *flags)


def _fitted(engine):
    """The engine's budget fed steps of a known cost (its own timing left out)."""
    engine.step_budget._steps.clear()
    _feed(engine.step_budget, a=0.016, b=0.0009, c=0.0003, steps=40)
    return engine


def _chunk_beside_two_decodes(engine) -> int:
    from kvmesh.services.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for seed in (1, 2):
        engine.add_request([5 + seed] * 20, params)
    while any(r.pending != 1 for r in engine.running) or engine.waiting:
        engine.step()
    engine.add_request(list(range(10, 610)), params)
    _fitted(engine).step()
    (long,) = [r for r in engine.running if len(r.tokens) == 600]
    return long.seq.length


def test_the_deepseek_engine_sizes_a_prompt_chunk_beside_decodes_to_the_target():
    # 50 ms - 16 ms - 2 rows x 0.9 ms leaves 32.2 ms: 107 tokens at 0.3 ms
    assert _chunk_beside_two_decodes(_engine("--step-slo-ms", "50")) == 107
    assert _chunk_beside_two_decodes(_engine("--step-slo-ms", "0")) == 256  # the chunk cap
    assert not _engine("--step-slo-ms", "50", "--deterministic").step_budget.active


def test_the_default_target():
    from kvmesh.services.engine.build import STEP_SLO_MS

    assert _engine().ecfg.step_slo_ms == STEP_SLO_MS > 0
    assert _engine("--step-slo-ms", "0").ecfg.step_slo_ms == 0
    with pytest.raises(ValueError, match="step_slo_ms must be >= 0"):
        _engine("--step-slo-ms", "-1")


def test_serve_threads_leave_a_cpu_for_the_server():
    import os

    from kvmesh.services.engine.cli import serve_threads

    cpus = len(os.sched_getaffinity(0))
    assert serve_threads(None, env={}) == max(1, cpus - 1)
    assert serve_threads(None, env={"OMP_NUM_THREADS": "3"}) == 3
    assert serve_threads(2, env={"OMP_NUM_THREADS": "3"}) == 2
    with pytest.raises(SystemExit, match="--threads"):
        serve_threads(0)
