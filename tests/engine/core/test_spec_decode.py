"""Speculative decoding is lossless (issue 12, "Must show"): greedy outputs with ngram:4,
with mtp:3 (a random MTP module: tests/engine/core/test_mtp.py pins its drafts and ring to the
reference) and with a drafter that is wrong on purpose at every draft position 0..k equal those of
`off` for 50 prompts whose generations cross block (16), CSA (4) and HCA (16) boundaries,
in float64 with every emitted token's logits <= 1e-9 of the run without speculation,
batched so that verify steps run beside other requests' prefill chunks. Truncation is on,
so snapshots are stored and blocks registered: the stored snapshots, the blocks handed to
the kvstore write-through and the snapshots handed to the directory are byte-identical to
the run that never saw a rejected token."""

import pytest
import torch

from kvmesh.errors import InvalidArgument
from services.engine.config import EngineConfig, small_test_config
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model import weights as weights_mod
from tests.engine.helpers import Recorder, make_engine, random_prompt, run_to_completion
from tests.engine.spec_helpers import OracleDrafter

CFG = small_test_config()          # W 16, CSA m 4, HCA m 16, block 16, B 6
EXACT = 1e-9
N_PROMPTS, MAX_TOKENS = 50, 18
SETTINGS = dict(truncation="compact", keep_tokens=22, num_slots=12, max_batched_tokens=80)


def prompts() -> list[list[int]]:
    """Lengths 10..58 (generations cross 16, 32, 48, 64); repeated motifs give n-gram hits."""
    out = []
    for i in range(N_PROMPTS):
        motif = random_prompt(3 + i % 5, i)
        n = 10 + i
        out.append((motif * 20)[: n - 4] + random_prompt(4, 500 + i))
    return out


# the seed-0 trunk plus a random MTP module (its own generator: the trunk's bytes are those of
# the baseline's weights, so `off` is the same model)
W_MTP = weights_mod.init_weights(CFG, seed=0, dtype=torch.float64, mtp=True)


def run(speculative="off", drafter=None):
    weights = W_MTP if speculative.startswith("mtp") else None
    engine = make_engine(CFG, speculative=speculative, weights=weights, **SETTINGS)
    if drafter is not None:
        engine.spec.drafter = drafter
    engine.hooks = Recorder()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts())]
    plans, schedule = [], engine.scheduler.schedule

    def spy(*a):
        plan = schedule(*a)
        plans.append((bool(plan.drafts), bool(plan.prefill)))
        return plan

    engine.scheduler.schedule = spy
    run_to_completion(engine)
    engine.mixed_steps = sum(d and p for d, p in plans)    # verify rows beside prefill chunks
    return engine, seqs


@pytest.fixture(scope="module")
def baseline():
    return run()


def assert_same_as_baseline(engine, seqs, baseline):
    base_engine, base_seqs = baseline
    for seq, ref in zip(seqs, base_seqs, strict=True):
        assert seq.output == ref.output, seq.request_id
        got = torch.stack(engine.logits[seq.request_id])
        want = torch.stack(base_engine.logits[ref.request_id])
        assert float((got - want).abs().max()) <= EXACT, seq.request_id
    stored = {k: s.data for k, s in engine.prefix.store.items()}
    assert len(stored) >= N_PROMPTS and len(engine.hooks.blocks) >= N_PROMPTS
    assert stored == {k: s.data for k, s in base_engine.prefix.store.items()}
    assert engine.hooks.blocks == base_engine.hooks.blocks
    assert engine.hooks.published == base_engine.hooks.published
    assert engine.cache.pool.stats().in_use == 0


def test_ngram_greedy_equals_off(baseline):
    engine, seqs = run("ngram:4")
    assert_same_as_baseline(engine, seqs, baseline)
    s = engine.stats()
    assert s["spec_accepted_tokens"] > 0 and s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
    assert engine.counters["steps"] < baseline[0].counters["steps"]
    assert engine.mixed_steps >= 5


def test_forced_rejection_at_every_position_equals_off(baseline):
    refs = [s.prompt + s.output for s in baseline[1]]
    engine, seqs = run("ngram:4", OracleDrafter(refs))
    assert_same_as_baseline(engine, seqs, baseline)
    s = engine.stats()
    for j in range(1, 5):            # every position was both accepted and rejected
        assert 0 < s[f"spec_accepted_pos{j}"] < s[f"spec_drafted_pos{j}"], j
    assert s["spec_accepted_pos4"] > 0          # whole drafts accepted: the bonus token path
    assert engine.mixed_steps >= 5


def test_mtp_greedy_equals_off(baseline):
    """mtp:3 with a random MTP module: drafts come from the batched MTP forward beside
    prefill chunks, are rejected (and, rarely, accepted), and nothing changes."""
    engine, seqs = run("mtp:3")
    assert_same_as_baseline(engine, seqs, baseline)
    s = engine.stats()
    assert s["spec_drafted_tokens"] > 0 and s["spec_verify_steps"] > N_PROMPTS
    assert engine.mixed_steps >= 5


def test_bad_settings_name_the_field():
    with pytest.raises(InvalidArgument, match="speculative: K = 7 exceeds B = 6"):
        EngineCore(CFG, EngineConfig(speculative="ngram:7"))
    with pytest.raises(InvalidArgument, match="speculative: unknown method 'medusa'"):
        EngineCore(CFG, EngineConfig(speculative="medusa:2"))
    with pytest.raises(InvalidArgument, match="speculative: mtp needs MTP weights"):
        EngineCore(CFG, EngineConfig(speculative="mtp:2"))
    engine = make_engine(CFG, speculative="ngram:3")
    for bad, msg in (("ngram:4", "not allowed on this engine"), ("mtp:1", "not allowed"),
                     ("ngram", "needs a draft count"), ("x:1", "unknown method")):
        with pytest.raises(InvalidArgument, match=f"speculative: .*{msg}"):
            engine.add_request([1, 2, 3], SamplingParams(speculative=bad))
    assert not engine.requests
    seq = engine.add_request([1, 2, 3] * 5, SamplingParams(temperature=0, max_tokens=8,
                                                            speculative="off"))
    run_to_completion(engine)
    assert len(seq.output) == 8 and engine.stats()["spec_verify_steps"] == 0


def slot_view(engine, seq) -> dict:
    """The bytes a continuation of seq can read: SWA ring rows of the window [nc - W, nc)
    of every layer, compression / indexer tail rows of the open group, and the entry rows
    of every completed group (through the block table)."""
    nc, st = seq.num_computed, engine.cache.states
    out = {}
    pos = torch.arange(max(0, nc - CFG.window), nc)
    for layer, ring in st.swa.items():
        out[f"swa{layer}"] = ring[seq.slot, pos.remainder(ring.shape[1])].clone()
    for name, rings in (("cmp", st.cmp), ("idx", st.idx)):
        for layer, ring in rings.items():
            m = CFG.compress_ratio(layer)
            tail = torch.arange(nc // m * m, nc)
            out[f"{name}{layer}"] = ring[seq.slot, tail.remainder(ring.shape[1])].clone()
    for name, store in (("entries", engine.cache.store.entries),
                        ("keys", engine.cache.store.index_keys)):
        for layer, rows in store.items():
            m, per = CFG.compress_ratio(layer), rows.shape[1]
            j = torch.arange(nc // m)
            blocks = torch.tensor(seq.table, dtype=torch.long)[j // per]
            out[f"{name}{layer}"] = rows[blocks, j % per].clone()
    return out


def test_slot_bytes_after_every_rollback_equal_a_run_without_drafts():
    """After each verify step (drafts rejected at every position in turn), the kept
    positions' slot rows and entries equal, byte for byte, those of the same request run
    without speculation when it has computed as many tokens."""
    prompt = random_prompt(37, 77)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off = make_engine(CFG, num_slots=1)
    ref_seq = off.add_request(prompt, params)
    run_to_completion(off)
    ref_tokens = prompt + ref_seq.output
    spec = make_engine(CFG, num_slots=1, speculative="ngram:6")
    spec.spec.drafter = OracleDrafter([ref_tokens])
    off = make_engine(CFG, num_slots=1)
    seq, ref_seq = spec.add_request(prompt, params), off.add_request(prompt, params)
    compared = 0
    while spec.has_work:
        spec.step()
        if seq.finished:
            break
        while ref_seq.num_computed < seq.num_computed:
            off.step()
        assert ref_seq.num_computed == seq.num_computed and ref_seq.tokens == seq.tokens
        want, got = slot_view(off, ref_seq), slot_view(spec, seq)
        for key in want:
            assert torch.equal(got[key], want[key]), (key, seq.num_computed)
        compared += 1
    assert compared >= 6 and spec.stats()["spec_accepted_pos6"] > 0
