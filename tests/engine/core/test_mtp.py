"""The MTP drafter (model/mtp.py, model/mtp_runner.py, core/mtp_draft.py) against the
uncached reference: every proposal's draft logits, at every chained depth, equal those of
the MTP block run over the whole sequence (trunk hidden states from reference.forward),
and after every verify step (drafts rejected at each position in turn) the MTP ring rows
of the kept window are byte-identical to the MXFP8 of the reference block's KV. float64."""

import pytest
import torch

from kernels import mxfp8
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import mtp, ops, reference
from services.engine.model import weights as weights_mod
from tests.engine.helpers import make_engine, random_prompt, run_to_completion
from tests.engine.spec_helpers import OracleDrafter

CFG = small_test_config()          # W 16, block 16, B 6: the MTP ring has 22 rows
EXACT = 1e-9
W64 = weights_mod.init_weights(CFG, seed=5, dtype=torch.float64, mtp=True)


def reference_chain(tokens: list[int], c: int, drafts: list[int]):
    """Reference MTP logits of a proposal at c computed tokens: row c - 1 from the trunk,
    then one chained row per draft but the last. Also the block inputs of rows 0..c-1."""
    hid = reference.forward(W64, CFG, torch.tensor(tokens[:c])).hidden
    x = mtp.project(W64, CFG, hid, torch.tensor(tokens[1 : c + 1]))
    y = mtp.reference_block(W64, CFG, x)
    out = [mtp.logits(W64, CFG, y[-1])]
    for d in drafts[:-1]:
        x = torch.cat([x, mtp.project(W64, CFG, y[-1:], torch.tensor([d]))])
        y = mtp.reference_block(W64, CFG, x)
        out.append(mtp.logits(W64, CFG, y[-1]))
    return torch.stack(out), x


def ring_reference_bytes(x, positions):
    view, bcfg = mtp.block_view(W64), mtp.block_config(CFG)
    h = ops.rms_norm(x, view["layers.0.attn_norm"], CFG.norm_eps)
    _, kv = ops.query_and_kv(view, 0, h, torch.arange(len(x)), bcfg)
    return mxfp8.quantize(kv[positions])


@pytest.fixture(scope="module")
def reference_run():
    prompt = random_prompt(41, 9)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    off = make_engine(CFG, weights=W64, num_slots=1)
    seq = off.add_request(prompt, params)
    run_to_completion(off)
    return prompt, params, prompt + seq.output


def draft_logits(drafter) -> list[torch.Tensor]:
    """The MTP logits of each draft depth of the last proposal (one running request): what
    the drafter's runner returned, recorded as it returns it."""
    calls: list[torch.Tensor] = []
    forward = drafter.runner.forward

    def spy(rows):
        y, logits = forward(rows)
        calls.append(logits[0].clone())
        return y, logits

    drafter.runner.forward = spy
    return calls


def test_draft_logits_and_ring_rows_equal_the_reference(reference_run):
    prompt, params, ref_tokens = reference_run
    engine = make_engine(CFG, weights=W64, num_slots=1, speculative="mtp:3")
    drafter = engine.spec.mtp
    oracle = OracleDrafter([ref_tokens])          # wrong on purpose at each position in turn
    seen, calls = [], draft_logits(drafter)
    propose = drafter.propose

    def spy(wanted):
        calls.clear()
        out = propose(wanted)
        for seq, _ in wanted:
            if seq.request_id in out:
                c = seq.num_computed
                seen.append((c, list(seq.tokens), out[seq.request_id],
                             torch.stack(calls), drafter.rings[seq.request_id].lo,
                             drafter.runner.ring[seq.slot].clone()))
                # the MTP module ran (ring rows written, chain computed); the verify step
                # judges oracle drafts instead, so every accepted length 0..k happens
                out[seq.request_id] = oracle.propose(seq.tokens, len(out[seq.request_id]))
        return out

    drafter.propose = spy
    seq = engine.add_request(prompt, params)
    run_to_completion(engine)
    assert seq.prompt + seq.output == ref_tokens
    assert len(seen) >= 8
    for c, tokens, drafts, q, lo, ring in seen:
        want, x = reference_chain(tokens, c, drafts)
        assert float((q - want).abs().max()) <= EXACT, c
        assert drafts == want.argmax(-1).tolist()
        # ring rows of the window the next draft reads, as the reference block's KV bytes
        pos = torch.arange(max(lo, c - CFG.window), c)
        got = ring[pos.remainder(ring.shape[0])]
        assert torch.equal(got, ring_reference_bytes(x, pos)), c
    s = engine.stats()
    for j in range(1, 4):
        assert 0 < s[f"spec_accepted_pos{j}"] < s[f"spec_drafted_pos{j}"], j


def test_a_snapshot_hit_restarts_the_window_and_outputs_stay_exact(reference_run):
    """With YOCO truncation (hidden states only from dec_lo) a second request extending the
    first's prompt resumes from its snapshot: the MTP ring of its slot starts at the resume
    point (it is never stored), drafts still run, and tokens and logits equal the same two
    requests without speculation."""
    prompt, params, ref_tokens = reference_run
    runs = {}
    for spec in ("off", "mtp:2"):
        engine = make_engine(CFG, weights=W64, num_slots=2, speculative=spec,
                             truncation="compact", keep_tokens=22)
        first = engine.add_request(prompt, params)
        run_to_completion(engine)
        second = engine.add_request(ref_tokens[:60], params)
        run_to_completion(engine)
        assert engine.counters["snapshot_hits"] == 1
        runs[spec] = (engine, [first, second])
    (off, want), (spec, got) = runs["off"], runs["mtp:2"]
    for a, b in zip(got, want, strict=True):
        assert a.output == b.output
        diff = torch.stack(spec.logits[a.request_id]) - torch.stack(off.logits[b.request_id])
        assert float(diff.abs().max()) <= EXACT
    assert spec.stats()["spec_drafted_tokens"] > 0


def test_an_mtp_engine_also_serves_ngram_requests_and_bounds_k():
    from kvmesh.errors import InvalidArgument
    from services.engine.core.speculative import SpecSetting, request_setting

    engine = SpecSetting("mtp", 3)
    assert request_setting(SamplingParams(speculative="ngram:3"), engine) == SpecSetting("ngram", 3)
    assert request_setting(SamplingParams(speculative="mtp:1"), engine) == SpecSetting("mtp", 1)
    assert request_setting(SamplingParams(), engine) == engine
    for bad in ("ngram:4", "mtp:4"):
        with pytest.raises(InvalidArgument, match="speculative: .*not allowed"):
            request_setting(SamplingParams(speculative=bad), engine)
    with pytest.raises(InvalidArgument, match="speculative: 'mtp:1' is not allowed"):
        request_setting(SamplingParams(speculative="mtp:1"), SpecSetting("ngram", 4))


def test_checkpoint_with_mtp_round_trips_and_a_partial_module_is_refused(tmp_path):
    weights_mod.save(W64, CFG, tmp_path / "m.safetensors")
    loaded = weights_mod.load(tmp_path / "m.safetensors", CFG)
    assert set(loaded) == set(W64) and mtp.has_mtp(loaded)
    trunk = weights_mod.init_weights(CFG, seed=5, dtype=torch.float64)
    assert all(torch.equal(trunk[k], W64[k]) for k in trunk)      # MTP init leaves the trunk be
    partial = {k: v for k, v in W64.items() if k != "mtp.eh_proj"}
    weights_mod.save(partial, CFG, tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="missing tensors.*mtp.eh_proj"):
        weights_mod.load(tmp_path / "p.safetensors", CFG)


def test_handoff_to_an_mtp_decode_engine_equals_unified(reference_run):
    """A prefill engine with an MTP ring (extra-state, 150-row SWA rings) hands off without
    it (the handoff state is the same size as without MTP); the decode engine's MTP ring
    starts at the handed-off position; tokens and logits equal a unified engine's."""
    from services.engine.core.sequence import Finish

    prompt, params, ref_tokens = reference_run
    unified = make_engine(CFG, weights=W64, num_slots=1)
    pe = make_engine(CFG, weights=W64, num_slots=1, extra_state=True, speculative="mtp:2")
    ce = make_engine(CFG, weights=W64, num_slots=1, speculative="mtp:2")
    assert pe.handoff_state_bytes == make_engine(CFG, weights=W64, num_slots=1).handoff_state_bytes
    ref = unified.add_request(prompt, params, request_id="r")
    run_to_completion(unified)
    pe.add_request(prompt, params, request_id="r", handoff=True)
    events = []
    while pe.has_work:
        events += pe.step()
    (h,) = [e.handoff for e in events if e.finish is Finish.HANDOFF]
    seq = ce.adopt(h)
    run_to_completion(ce)
    assert seq.output == ref.output
    got = torch.stack(pe.logits["r"] + ce.logits["r"])
    assert float((got - torch.stack(unified.logits["r"])).abs().max()) <= EXACT
    assert ce.stats()["spec_drafted_tokens"] > 0


def test_sampled_requests_with_mtp_drafts_give_the_tokens_of_off():
    """temperature > 0: drafts are the MTP argmax and verification keeps plain sampling's
    tokens, so the same seed gives the same tokens with mtp:3 or off, batched or alone."""
    params = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=24, ignore_eos=True)
    outs = []
    for n, spec in ((1, "mtp:3"), (3, "mtp:3"), (1, "off")):
        engine = make_engine(CFG, weights=W64, num_slots=3, speculative=spec)
        seqs = [engine.add_request(random_prompt(20, 30 + i) if i else random_prompt(20, 30),
                                   params) for i in range(n)]
        run_to_completion(engine)
        outs.append(seqs[0].output)
        if spec != "off":         # (a random module's drafts are rejected: no acceptance asked)
            assert engine.stats()["spec_drafted_tokens"] > 0
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 24


@pytest.mark.parametrize("r", [1, 3, 6])
def test_drafts_after_engine_rollback_equal_the_reference(r):
    """EngineCore.rollback(r) mid-generation: the MTP rows of the taken-back tokens are
    rewritten, so every later proposal's logits equal the reference chain again."""
    engine = make_engine(CFG, weights=W64, num_slots=1, speculative="mtp:2")
    seq = engine.add_request(random_prompt(45, 1), SamplingParams(temperature=0, max_tokens=24,
                                                                   ignore_eos=True))
    while len(seq.output) < 10:
        engine.step()
    engine.rollback(seq.request_id, r)
    drafter, seen = engine.spec.mtp, []
    propose, calls = drafter.propose, draft_logits(drafter)

    def spy(wanted):
        calls.clear()
        out = propose(wanted)
        for s, _ in wanted:
            if s.request_id in out:
                seen.append((s.num_computed, list(s.tokens), out[s.request_id], torch.stack(calls)))
        return out

    drafter.propose = spy
    run_to_completion(engine)
    assert len(seq.output) == 24 and seen
    for c, tokens, drafts, q in seen:
        want, _ = reference_chain(tokens, c, drafts)
        assert float((q - want).abs().max()) <= EXACT, c
