"""Rollback in use (issue 12): a rolled-back request keeps running, and nothing a rejected
token touched survives in a snapshot.

  * EngineCore.rollback(r) then step(): the request recomputes its last kept token and
    continues exactly (logits <= 1e-9 of the uncached reference), for every r in 0..B.
  * A verify step that wrote rejected tokens past a block boundary, rolled back to that
    boundary: the replica stored at it is byte-identical to the one of a run that never
    computed the rejected tokens (before the fix its rows older than the window held the
    rejected tokens' KV), and a request resuming from it equals a cold run.
"""

import pytest
import torch

from services.engine.core.sampling import SamplingParams
from services.engine.model import reference
from tests.engine.cache.test_snapshot_rules import CFG, KEEP, verify_step
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

EXACT = 1e-9
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("r", [0, 1, 2, 3, 4, 5, 6])
def test_step_after_rollback_continues_exactly(r):
    engine = make_engine(CFG)
    seq = engine.add_request(random_prompt(45, 1), GREEDY)
    while len(seq.output) < 7:                    # computed prompt + 6, one token pending
        engine.step()
    engine.rollback(seq.request_id, r)
    assert seq.num_computed == 45 + 6 - r == len(seq.tokens)
    run_to_completion(engine)
    assert len(seq.output) == GREEDY.max_tokens
    ref = reference.forward(engine.weights, CFG, seq.tokens[:-1]).logits
    got = torch.stack(engine.logits[seq.request_id][-7:])
    assert float((got - ref[-7:]).abs().max()) <= EXACT


def _replica_after(rejected: int):
    """Prompt 45, first token sampled; one verify step computes positions 45..47 (kept)
    and `rejected` more past the boundary at 48; roll them back; abort (stores the replica)."""
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP)
    seq = e.add_request(random_prompt(45, 61), SamplingParams(temperature=0, max_tokens=40,
                                                              ignore_eos=True))
    e.step()
    verify_step(e, seq, random_prompt(2, 62) + random_prompt(rejected, 63))
    if rejected:
        e.rollback(seq.request_id, rejected)
    assert seq.num_computed == 48 == len(seq.tokens)
    tokens = list(seq.tokens)
    e.abort(seq.request_id)
    snaps = {key: s for key, s in e.prefix.store.items()}
    return e, tokens, snaps


@pytest.mark.parametrize("rejected", [1, 3, 5])
def test_replica_kept_at_the_boundary_holds_no_rejected_token(rejected):
    _, tokens_ref, want = _replica_after(0)
    e, tokens, got = _replica_after(rejected)
    assert tokens == tokens_ref and sorted(s.position for s in got.values()) == [32, 48]
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].data == want[key].data, f"snapshot at {want[key].position} differs"
    # a new request over the same tokens resumes from the snapshot at 48, exactly as a
    # cold run (truncation on: the cold run of the same engine settings is the reference)
    prompt, params = tokens + random_prompt(30, 64), SamplingParams(temperature=0, max_tokens=3)
    seq = e.add_request(prompt, params)
    run_to_completion(e)
    assert e.counters["snapshot_hits"] == 1
    cold = make_engine(CFG, truncation="compact", keep_tokens=KEEP)
    ref_seq = cold.add_request(prompt, params)
    run_to_completion(cold)
    got_logits = torch.stack(e.logits[seq.request_id])
    ref = torch.stack(cold.logits[ref_seq.request_id])
    assert float((got_logits - ref).abs().max()) <= EXACT
