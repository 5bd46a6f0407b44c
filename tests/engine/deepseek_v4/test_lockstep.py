"""An Engine over a model split across 2 gloo ranks, run in lockstep (core/lockstep.py):
rank 0's engine and rank 1's stay the same (every step's events equal, unseeded sampling
included), and both give what one process's engine over the unsplit model gives: greedy and
seeded sampling, a prefix hit after a finished request (a snapshot hit under
--swa-policy full, a bounded replay under zero), an abort mid-decode, and a request an
unsplit prefill engine hands off (PD: the split engine serves the same model fingerprint).
Decisions made from step times (the step budget, the adaptive draft policy) are rank 0's on
every rank."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from kvmesh.services.engine import ranks
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core import lockstep
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.parallel import Groups, ParallelV4Model, shard_weights
from kvmesh.tokenizer import ByteTokenizer
from tests.engine.deepseek_v4.test_parallel import tiny

VOCAB = 512                      # above the byte tokenizer's 259 ids
NAME = "tiny"                    # the served name: a handoff checks it (the fingerprint)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)


def handoff(policy: str, slo_ms: float, speculative: str, spec_policy: str):
    """A request prefilled by an unsplit prefill engine and handed off (PD): its Handoff."""
    cfg, weights = tiny(speculative != "off", vocab_size=VOCAB)
    pe = Engine(V4Model(cfg, weights, torch.float64, stored=True, rows="exact"),
                dataclasses.replace(config(policy, slo_ms, speculative, spec_policy),
                                    role="prefill", extra_state=True),
                ByteTokenizer(), NAME)
    pe.add_request(prompt(200, 9), GREEDY, "pd", handoff=True)
    events = []
    while pe.has_work:
        events += pe.step()
    (last,) = [e for e in events if e.finish is not None]
    return last.handoff


def scenario(engine, handed) -> dict:
    """Requests through `engine` (an Engine or a lockstep.Leader): {request id: tokens},
    and each request's cached and replayed tokens. `handed`: a prefill engine's handoff,
    which this engine adopts and decodes."""
    tokens: dict[str, list[int]] = {}
    hits: dict[str, tuple[int, int]] = {}
    drafted = [0]

    def drain():
        while engine.has_work:
            for e in engine.step():
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
                # the unseeded request's tokens (and so its drafts' fate) differ run to run
                drafted[0] += e.drafted if e.request_id != "unseeded" else 0

    first = prompt(300, 1)
    reqs = [engine.add_request(first, GREEDY, "greedy"),
            engine.add_request(prompt(150, 2), SEEDED, "seeded"),
            engine.add_request(prompt(90, 3), UNSEEDED, "unseeded")]
    drain()
    reqs.append(engine.add_request(first + prompt(40, 4), GREEDY, "hit"))
    reqs.append(engine.add_request(prompt(60, 5), GREEDY, "aborted"))
    for _ in range(3):
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
    # a prompt beside decoding streams: under a step budget, prefilled in capped chunks
    reqs.append(engine.add_request(prompt(200, 6), GREEDY, "late"))
    engine.abort("aborted")
    drain()
    reqs.append(engine.adopt(handed))
    drain()
    for r in reqs:
        hits[r.request_id] = (r.cached_tokens, r.replayed_tokens)
    return {"tokens": tokens, "hits": hits, "drafted": drafted[0]}


def config(policy: str, slo_ms: float, speculative: str, spec_policy: str) -> EngineConfig:
    return EngineConfig(dtype="float64", num_slots=4, num_blocks=24, max_batched_tokens=128,
                        swa_policy=policy, step_slo_ms=slo_ms, speculative=speculative,
                        spec_policy=spec_policy)


def rank_main(split, policy: str, slo_ms: float, speculative: str, spec_policy: str,
              out: str) -> dict:
    cfg, weights = tiny(speculative != "off", vocab_size=VOCAB)
    model = ParallelV4Model(cfg, shard_weights(cfg, weights, split), torch.float64, split,
                            Groups(split), stored=True, rows="exact")
    engine = Engine(model, config(policy, slo_ms, speculative, spec_policy), ByteTokenizer(),
                    NAME)
    # each rank measures its own step costs: rank 0 rows nearly free (drafting pays), rank 1
    # rows dear (it would not draft). Only rank 0's may decide.
    row_s = 0.0001 if split.rank == 0 else 0.05
    engine.spec.policy.step_done = _costing(engine.spec.policy.step_done, row_s)
    return lead_or_follow(engine, split, out, lambda leader: scenario(
        leader, handoff(policy, slo_ms, speculative, spec_policy)) | {"spec": engine.spec.stats()})


def lead_or_follow(engine: Engine, split, out: str, lead) -> dict:
    """Rank 0 runs lead(its lockstep.Leader) and returns what it returns; another rank
    follows and pickles (its events by request, its speculation stats) to out/rankN.pkl."""
    if split.rank == 0:
        leader = lockstep.Leader(engine)
        try:
            return lead(leader)
        finally:
            leader.stop()
    events: dict[str, list[int]] = {}
    lockstep.follow(engine, lambda evs: [events.setdefault(e.request_id, []).extend(e.token_ids)
                                         for e in evs])
    with open(f"{out}/rank{split.rank}.pkl", "wb") as f:
        pickle.dump((events, engine.spec.stats()), f)
    return {}


def _costing(step_done, row_s: float):
    """The draft policy's step_done, told that a step took 10 ms + row_s a row."""
    def told(decode_rows: int, draft_rows: int, other_tokens: int, seconds: float,
             drafting: int = 0) -> None:
        step_done(decode_rows, draft_rows, other_tokens, 0.010 + row_s * (decode_rows + draft_rows),
                  drafting)
    return told


@pytest.mark.parametrize("policy,slo_ms,speculative,spec_policy", [
    ("full", 0.0, "off", "always"), ("zero", 0.0, "off", "always"),
    ("full", 1.0, "off", "always"), ("full", 0.0, "mtp:2", "always"),
    ("full", 0.0, "mtp:2", "adaptive")])
@pytest.mark.timeout(240)    # ranks out of step meet in mismatched collectives: they hang
def test_a_split_engine_in_lockstep_serves_what_one_process_does(tmp_path, policy, slo_ms,
                                                                 speculative, spec_policy):
    """slo_ms 1: the step budget caps prefill beside decodes from rank 0's step times (to
    32 tokens a step once it has a fit), on every rank alike. mtp:2: MTP drafts (the MTP
    block replicated, its head gathered) verified by the split model; under the adaptive
    policy every rank drafts what rank 0's step times decide (a rank drafting otherwise
    would run other rows than rank 0 and meet it in mismatched collectives)."""
    cfg, weights = tiny(speculative != "off", vocab_size=VOCAB)
    alone = scenario(Engine(V4Model(cfg, weights, torch.float64, stored=True, rows="exact"),
                            config(policy, slo_ms, speculative, spec_policy), ByteTokenizer(),
                            NAME),
                     handoff(policy, slo_ms, speculative, spec_policy))
    split = ranks.run(rank_main, (policy, slo_ms, speculative, spec_policy, str(tmp_path)), 2, 1)
    with open(tmp_path / "rank1.pkl", "rb") as f:
        events, spec = pickle.load(f)
    assert events == split["tokens"]                       # the ranks stayed in step
    assert spec == split["spec"]                           # and drafted alike
    for rid in ("greedy", "seeded", "hit", "late", "pd"):
        assert split["tokens"][rid] == alone["tokens"][rid], rid
        assert len(split["tokens"][rid]) == (9 if rid == "pd" else 10)   # pd: 1 from the PE
    assert split["hits"] == alone["hits"]
    assert (split["drafted"] > 0) == (speculative != "off")
    if spec_policy == "always":      # the adaptive policy drafts from this run's step times
        assert split["drafted"] == alone["drafted"]
    else:
        assert split["spec"]["spec_policy_plain_steps"] > 0      # it chose, both ways
        assert split["spec"]["spec_policy_drafted_steps"] > 0
    cached, replayed = split["hits"]["hit"]
    assert cached == 256 and (replayed > 0) == (policy == "zero")
    assert 0 < len(split["tokens"]["aborted"]) < 10


def test_a_draft_policy_that_follows_anothers_costs_drafts_as_it_does():
    from kvmesh.services.engine.core.draft_policy import DraftPolicy

    leader, follower = DraftPolicy(2, True, True), DraftPolicy(2, True, True)
    for i in range(12):              # decode-only steps of 1 and 2 rows
        rows = 1 + i % 2
        leader.step_done(rows, 0, 0, 0.010 + 0.0001 * rows)      # rows nearly free: draft
        follower.step_done(rows, 0, 0, 0.010 + 0.05 * rows)      # rows dear: a plain step
    wants = {"r": (2, 10)}
    assert leader.allot(1, wants) == {"r": 2} and follower.allot(1, wants) == {}
    follower.follow(leader.costs())
    assert follower.allot(1, wants) == leader.allot(1, wants) == {"r": 2}


def test_a_budget_that_follows_anothers_steps_caps_as_it_does():
    from kvmesh.services.engine.core.step_budget import StepBudget

    leader, follower = StepBudget(50.0), StepBudget(50.0)
    for rows, tokens, seconds in [(1, 0, 0.010), (4, 64, 0.030), (8, 0, 0.014), (2, 128, 0.045),
                                  (16, 32, 0.028), (1, 256, 0.070), (6, 16, 0.019)]:
        leader.observe(rows, tokens, seconds)
        follower.observe(rows, tokens * 2, seconds * 3)      # its own, other, times
    assert follower.prefill_cap(8) != leader.prefill_cap(8)
    follower.follow(leader.steps())
    assert [follower.prefill_cap(r) for r in (1, 8, 32)] == [leader.prefill_cap(r) for r in (1, 8, 32)]

