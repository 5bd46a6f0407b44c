"""Ragged steps: decode rows and a long prefill chunk share one forward with no padded rows;
the ragged kernels agree with the padded reference kernels; the chunk cap bounds a step."""

import pytest
import torch

from kernels import mxfp8
from kernels.attention import union_attention
from kernels.ragged import ragged_union_attention
from kernels.ring_rows import dequantize_rows
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import ops
from services.engine.model import runner as runner_mod
from tests.engine.core.test_equivalence import EXACT, max_logit_error
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()


def start_decoders(engine, n, prompt_len=20):
    seqs = [engine.add_request(random_prompt(prompt_len, 100 + i),
                               SamplingParams(temperature=0, max_tokens=30)) for i in range(n)]
    while any(s.prefilling or s.slot is None for s in seqs):
        engine.step()
    return seqs


def test_mixed_step_computes_no_padded_rows(monkeypatch):
    engine = make_engine(CFG, num_slots=32, max_running=32, num_blocks=512, max_batched_tokens=600)
    decoders = start_decoders(engine, 31)
    long_seq = engine.add_request(random_prompt(500, 7), SamplingParams(temperature=0, max_tokens=4))

    # count the rows that really go through the layers: every FFN call and every attention
    # call (the hidden states and queries), independent of what the runner reports
    ffn_rows, attn_rows = [], []
    ffn, attn = ops.ffn, runner_mod.ragged_union_attention
    monkeypatch.setattr(ops, "ffn", lambda w, layer, x, cfg: ffn_rows.append(x.shape[0]) or ffn(w, layer, x, cfg))
    monkeypatch.setattr(runner_mod, "ragged_union_attention",
                        lambda q, *a: attn_rows.append(q.shape[0]) or attn(q, *a))
    engine.step()
    assert long_seq.num_computed == 500 and all(not s.prefilling for s in decoders)
    assert ffn_rows == [531] * CFG.n_layers, ffn_rows          # 500 chunk rows + 31 decode rows
    assert sum(attn_rows) == 531 * CFG.n_layers, attn_rows
    assert engine.last_rows == {"encoder": 531, "decoder": 531}
    monkeypatch.undo()

    run_to_completion(engine)
    for seq in (long_seq, decoders[0], decoders[-1]):
        assert max_logit_error(engine, CFG, seq) <= EXACT


def test_long_prefill_chunk_caps_each_step():
    engine = make_engine(CFG, num_slots=8, max_batched_tokens=512, long_prefill_chunk=64)
    decoders = start_decoders(engine, 4)
    long_seq = engine.add_request(random_prompt(300, 8), SamplingParams(temperature=0, max_tokens=2))
    steps = 0
    while long_seq.prefilling or long_seq.slot is None:
        before = [len(s.output) for s in decoders]
        engine.step()
        steps += 1
        assert engine.last_rows["encoder"] <= 64 + 4
        assert [len(s.output) for s in decoders] == [b + 1 for b in before], "decodes go first"
    assert steps == 5                                             # ceil(300 / 64)
    run_to_completion(engine)
    assert max_logit_error(engine, CFG, long_seq) <= EXACT


def test_decode_rows_beside_a_long_chunk_carry_only_their_own_candidates(monkeypatch):
    """A decode row's compressed candidates (index, mask, indexer scan) stop at the most
    entries its own sequences have, not at the long prompt's beside it in the step."""
    engine = make_engine(CFG, num_slots=8, max_batched_tokens=600)
    decoders = start_decoders(engine, 3)                          # 20-token prompts
    long_seq = engine.add_request(random_prompt(500, 7), SamplingParams(temperature=0, max_tokens=2))
    widths: dict[tuple[int, int], int] = {}           # (m, rows) -> candidates per row
    candidates = runner_mod._candidates

    def record(*a, **kw):
        index, wid, n_visible = candidates(*a, **kw)
        widths[(a[2], wid.shape[0])] = index.shape[-1]
        return index, wid, n_visible

    monkeypatch.setattr(runner_mod, "_candidates", record)
    ends = [s.num_tokens for s in decoders]        # each decode row's end in the coming step
    engine.step()
    assert long_seq.num_computed == 500
    for m in (CFG.csa_m, CFG.hca_m):
        assert widths[(m, 3)] == max(ends) // m, (m, widths)      # the decode rows: their own
    assert widths[(CFG.csa_m, 500)] == 500 // CFG.csa_m            # the chunk: its pool, all
    assert max(ends) // CFG.csa_m > CFG.csa_topk                   # the indexer did run
    monkeypatch.undo()
    run_to_completion(engine)
    for seq in (long_seq, *decoders):
        assert max_logit_error(engine, CFG, seq) <= EXACT


def test_lut_dequantize_is_bit_identical():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 512, generator=g) * torch.logspace(-30, 30, 300).unsqueeze(1)
    x[0] = 0
    q = mxfp8.quantize(x)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(dequantize_rows(q, dtype), mxfp8.dequantize(q, dtype))


@pytest.mark.parametrize("shared", [True, False])
def test_ragged_attention_matches_padded_per_sequence(shared):
    g = torch.Generator().manual_seed(1)
    lens, k, h, d = [1, 5, 1, 3], 7, 2, 16
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    qs = [torch.randn(n, h, d, generator=g, dtype=torch.float64) for n in lens]
    keys = [torch.randn(k, d, generator=g, dtype=torch.float64) for _ in lens]
    oks = [torch.rand(n, k, generator=g) < 0.7 for n in lens]
    want = torch.cat([union_attention(q[None], [(kk[None], ok[None])], sink, 0.3)[0]
                      for q, kk, ok in zip(qs, keys, oks, strict=True)])
    if shared:       # one pool of every sequence's keys, masked to the row's own sequence
        pool = torch.cat(keys)
        ok = torch.zeros(sum(lens), len(pool), dtype=torch.bool)
        r = 0
        for i, (n, o) in enumerate(zip(lens, oks, strict=True)):
            ok[r : r + n, i * k : (i + 1) * k] = o
            r += n
        group = (pool, ok)
    else:            # each row's own key set
        group = (torch.cat([kk.expand(n, k, d) for kk, n in zip(keys, lens, strict=True)]), torch.cat(oks))
    got = ragged_union_attention(torch.cat(qs), [group], sink, 0.3)
    assert torch.allclose(got, want, atol=1e-13, rtol=0)


def test_window_mirror_dropped_on_rollback_and_slot_reuse():
    """The runner's dequantized window mirror must never outlive a rollback or a new owner of
    the slot: every emitted logit row still matches the reference afterwards."""
    from services.engine.model import reference

    engine = make_engine(CFG, num_slots=1, max_batched_tokens=64)
    for prompt_len, seed in ((45, 1), (61, 2)):        # the second request reuses slot 0
        # ignore_eos: an early EOS would leave fewer than 9 rows after the rollback, and the
        # last 9 would then include rolled-back rows (a flaky mismatch, ~1 run in 10)
        seq = engine.add_request(random_prompt(prompt_len, seed), SamplingParams(
            temperature=0.8, max_tokens=12, ignore_eos=True))
        while len(seq.output) < 6:
            engine.step()
        engine.rollback(seq.request_id, 3)          # computed prompt + 5 -> prompt + 2
        assert len(seq.output) == 2
        engine.cache.append_token(seq, 7)            # a different continuation than sampled
        run_to_completion(engine)
        ref = reference.forward(engine.weights, CFG, seq.tokens[:-1]).logits
        got = torch.stack(engine.logits[seq.request_id][-9:])
        assert float((got - ref[-9:]).abs().max()) <= EXACT
