"""A pool too small for the load forces preemption; results must not change."""

from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion


def run(num_blocks):
    engine = make_engine(small_test_config(), num_slots=4, num_blocks=num_blocks,
                         max_batched_tokens=48)
    params = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=30)]
    seqs = [engine.add_request(random_prompt(n, n), params[i % 2])
            for i, n in enumerate((60, 130, 45, 200, 95, 150))]
    run_to_completion(engine)
    return [s.output for s in seqs], sum(s.preemptions for s in seqs), engine


def test_tiny_pool_preempts_and_gives_the_same_tokens():
    big, big_preempt, _ = run(num_blocks=512)
    small, small_preempt, engine = run(num_blocks=20)
    assert big_preempt == 0
    assert small_preempt > 0, "the small pool must actually force preemption"
    assert small == big
    stats = engine.stats()
    assert stats["blocks_in_use"] == 0 and stats["slots_in_use"] == 0


def test_a_sequence_larger_than_the_pool_finishes_with_length():
    engine = make_engine(small_test_config(), num_slots=2, num_blocks=4)
    seq = engine.add_request(random_prompt(40, 1), SamplingParams(temperature=0, max_tokens=100))
    run_to_completion(engine)
    assert seq.finish.value == "length" and len(seq.output) < 100
