"""The adaptive speculation policy (issue 46): drafts only where the measured verify cost
and the acceptance seen so far promise more tokens per second than a plain step, learns
prompt-lookup acceptance from proposals it did not verify, measures what it lacks, and
never gives a request more than its setting."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.draft_policy import EXPLORE_EVERY, DraftPolicy
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams


def measured(policy: DraftPolicy, n: int, a: float, b: float) -> None:
    """Step costs as the engine reports them: steps of n decode rows, plain and with drafts,
    each taking a + b rows seconds."""
    for drafts in (0, n, 0, 3 * n, 0, 2 * n):
        policy.step_done(n, drafts, 0, a + b * (n + drafts))


def scored(policy: DraftPolicy, rid: str, accepted_of_4: int, times: int = 20) -> None:
    """`times` proposals of 4 drafts, the first `accepted_of_4` of which came true."""
    out: list[int] = []
    for _ in range(times):
        drafts = [7, 8, 9, 10]
        policy.proposed(rid, len(out), drafts)
        out += drafts[:accepted_of_4] + [99]
        policy.score(rid, out)


def test_a_proposal_is_scored_against_the_tokens_emitted_after_it():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    p.proposed("r", 3, [5, 6, 7])
    p.score("r", [0, 1, 2, 5, 6])               # two match so far, the third not yet known
    assert p.pending["r"] and p.engine.scored == [0, 0, 0, 0]
    p.score("r", [0, 1, 2, 5, 6, 9])             # the third missed: settled, 2 of 3 accepted
    assert "r" not in p.pending
    assert p.engine.scored[:3] == [1, 1, 1] and p.engine.accepted[:3] == [1, 1, 0]
    assert p.requests["r"].accepted[:3] == [1, 1, 0]


def test_gains_are_the_chance_that_every_draft_up_to_j_is_accepted():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    scored(p, "good", 4)
    scored(p, "bad", 0)
    good, bad = p.gains("good", 4, 80), p.gains("bad", 4, 80)
    assert all(g > 0.7 for g in good) and all(g < 0.3 for g in bad)
    assert good == sorted(good, reverse=True) and bad == sorted(bad, reverse=True)


def test_cheap_verify_rows_draft_everything_proposed():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    measured(p, 8, a=0.010, b=0.0)                         # a draft row costs nothing
    scored(p, "r0", 1)
    wants = {f"r{i}": (4, 80) for i in range(8)}
    assert p.allot(8, wants) == {f"r{i}": 4 for i in range(8)}


def test_costly_rows_and_poor_acceptance_decode_plainly():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    measured(p, 8, a=0.002, b=0.001)                       # a row costs as much as it yields
    for i in range(8):
        scored(p, f"r{i}", 0)
    assert p.allot(8, {f"r{i}": (4, 80) for i in range(8)}) == {}
    assert p.counters["spec_policy_plain_steps"] == 1
    assert p.counters["spec_withheld_tokens"] == 32


def test_only_the_requests_whose_drafts_pay_draft():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    measured(p, 8, a=0.006, b=0.0005)                      # a row: half the yield of a plain one
    for i in range(8):
        scored(p, f"r{i}", 4 if i < 2 else 0)
    got = p.allot(8, {f"r{i}": (4, 80) for i in range(8)})
    assert got == {"r0": 4, "r1": 4}


def test_a_request_never_gets_more_drafts_than_it_may_take():
    p = DraftPolicy(6, adaptive=True, learn_from_proposals=True)
    measured(p, 2, a=0.010, b=0.0)
    scored(p, "a", 4)
    assert p.allot(2, {"a": (2, 80), "b": (0, 80)}) == {"a": 2}


def test_what_is_not_measured_is_measured_first():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    wants = {"a": (4, 10), "b": (3, 10)}
    got = []
    for _ in range(6):                                     # nothing known: alternate and time
        d = p.allot(2, wants)
        got.append(d)
        p.step_done(2, sum(d.values()), 0, 0.010 + 0.004 * sum(d.values()), len(d))
    # probes: one request at a time, all its drafts or one, by turns
    assert got[:5] == [{"a": 4}, {}, {"b": 1}, {}, {"b": 3}]
    assert p.row_cost() == pytest.approx(0.004)
    # known: a row's 0.004 s is dearer than the 0.5 token it is expected to give (a plain
    # step gives a token per 0.005 s)
    assert got[5] == {}


def test_costs_follow_a_machine_that_slows_down():
    """Step differences, not levels: a machine that slows down between steps moves plain and
    drafted steps alike, and the row cost stays what consecutive steps show."""
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    for i in range(20):
        slow = 0.01 * (i // 5)                             # every 5 steps 10 ms slower
        drafts = 8 * (i % 2)
        p.step_done(8, drafts, 0, 0.010 + slow + 0.0005 * (8 + drafts))
    assert p.row_cost() == pytest.approx(0.0005, rel=0.5)
    assert p.base_s(8, p.row_cost()) > 0.04               # the current level, not the first


def spans_measured(policy: DraftPolicy, n: int, a: float, b: float, c: float) -> None:
    """Steps of n decode rows taking a + b rows + c per drafting request, with drafts spread
    unevenly (so rows and requests vary apart)."""
    for drafts, drafting in ((0, 0), (n, n), (0, 0), (3, 1), (0, 0), (2 * n, n // 2),
                             (0, 0), (6, 2)):
        policy.step_done(n, drafts, 0, a + b * (n + drafts) + c * drafting, drafting)


def test_a_drafting_requests_own_cost_is_fit_apart_from_its_rows():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    spans_measured(p, 16, a=0.020, b=0.0004, c=0.0023)
    b, c = p.fit()
    assert b == pytest.approx(0.0004, rel=1e-6) and c == pytest.approx(0.0023, rel=1e-6)
    assert p.base_s(16, b, c) == pytest.approx(0.020 + 0.0004 * 16)


def test_a_dear_span_keeps_a_full_batch_plain_and_a_lone_request_drafting():
    """The CPU's measured shape: a verify span attends alone (2.3 ms a request), a row costs
    0.4 ms. Sixteen requests whose drafts come true half the time: a row's slope alone says
    draft, the span's cost says not. One request whose drafts mostly come true drafts."""
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    spans_measured(p, 16, a=0.020, b=0.0004, c=0.0023)
    for i in range(16):
        scored(p, f"r{i}", 2)
    assert p.gains("r0", 4, 80)[0] > 0.6
    assert p.allot(16, {f"r{i}": (1, 80) for i in range(16)}) == {}
    lone = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    spans_measured(lone, 1, a=0.004, b=0.0004, c=0.0023)
    scored(lone, "r", 4)
    assert lone.allot(1, {"r": (4, 80)}) == {"r": 4}


def test_the_other_choice_is_taken_every_so_often():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    measured(p, 8, a=0.002, b=0.001)
    for i in range(8):
        scored(p, f"r{i}", 0)
    wants = {f"r{i}": (4, 80) for i in range(8)}
    choices = [p.allot(8, wants) for _ in range(2 * EXPLORE_EVERY)]
    drafted = [i for i, c in enumerate(choices) if c]
    assert len(drafted) == 2 and all(len(choices[i]) == 1 for i in drafted)    # probes


def test_steps_that_prefill_are_not_measured():
    p = DraftPolicy(4, adaptive=True, learn_from_proposals=True)
    p.step_done(4, 0, 100, 0.5)
    p.step_done(4, 8, 100, 0.5)
    assert not p.pairs and not p.recent
    p.step_done(4, 0, 0, 0.1)
    p.step_done(4, 0, 100, 0.5)          # between two decode-only steps: no difference taken
    p.step_done(4, 8, 0, 0.2)
    assert not p.pairs and len(p.recent) == 2


def test_always_drafts_everything_whatever_it_costs():
    p = DraftPolicy(4, adaptive=False, learn_from_proposals=True)
    measured(p, 8, a=0.002, b=0.01)
    scored(p, "r", 0)
    assert p.allot(1, {"r": (4, 80)}) == {"r": 4}


@pytest.mark.parametrize("stale", [False, True])
def test_an_mtp_request_kept_from_drafting_falls_back_to_the_engine_rate(stale):
    p = DraftPolicy(2, adaptive=True, learn_from_proposals=False)
    p.proposed("r", 0, [1, 2])                             # MTP: proposals are not scored
    assert "r" not in p.pending
    for i in range(10):
        p.verified("r", 2, 0, i)                           # its drafts always failed
        p.verified(f"other{i}", 2, 2, i)                   # others' always passed
    now = 10 + (40 if stale else 0)
    g = p.gains("r", 2, now)
    assert (g[0] > 0.5) == stale


# --- the policy in the engine -------------------------------------------------------------
def costs_forced(policy: DraftPolicy, cheap: bool) -> None:
    """Step costs set by hand: drafted rows free (cheap) or each as dear as a whole plain step."""
    b = 0.0 if cheap else 1.0
    policy.pairs = deque([(1, 0, b)] * 8)
    policy.recent = deque([(4, 0, 1.0)])


def run_engine(model, tok, prompts, params, speculative: str):
    """The requests to the end; with speculation, the policy's costs flip every 3 steps.
    -> (outputs, per request the set of {drafted, plain} its decode steps were)."""
    core = Engine(model, EngineConfig(num_slots=4, max_running=4, num_blocks=64,
                                      max_batched_tokens=4096, speculative=speculative,
                                      swa_policy="zero"), tok, name="policy")
    policy = core.spec.policy
    policy.step_done = lambda *a: None                      # no real timing
    seen: dict[str, set[str]] = {}
    propose = core.spec.propose

    def spy(running):
        out = propose(running)
        for r in running:
            if r.pending == 1 and r.request_id in core.spec.requests:
                seen.setdefault(r.request_id, set()).add("drafted" if r.request_id in out else "plain")
        return out

    core.spec.propose = spy
    reqs = [core.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    step = 0
    while core.has_work:
        costs_forced(policy, cheap=(step // 3) % 2 == 0)
        core.step()
        step += 1
    return [r.output for r in reqs], seen, core.stats()


@pytest.fixture(scope="module")
def shipped():
    from bench.common import load_model
    from kvmesh.shipped import DEFAULT_MODEL
    return load_model(DEFAULT_MODEL)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_switching_drafting_on_and_off_mid_request_keeps_the_tokens_of_off(shipped, params):
    model, tok = shipped
    text = Path(__file__).read_text()[:600]
    prompts = [tok.encode(text[i * 50:]) for i in range(3)]
    want, _, _ = run_engine(model, tok, prompts, params, "off")
    got, seen, stats = run_engine(model, tok, prompts, params, "ngram:4")
    assert got == want
    assert all(s == {"drafted", "plain"} for s in seen.values()) and len(seen) == 3
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_policy_plain_steps"] > 0
    assert stats["spec_withheld_tokens"] > 0
