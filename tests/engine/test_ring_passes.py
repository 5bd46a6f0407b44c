"""The CPU throughput paths compute the same numbers as the plain ones: ring attention done a
few slots at a time (kernels/ragged.py RING_PASS_BYTES), MXFP8 quantize + values in one pass,
and CSA layers skipping the indexer when no row sees more than top-k entries."""

import pytest
import torch

from kernels import mxfp8, ragged
from kernels.ragged import RingKeys, SlotRows, ragged_union_attention
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import runner as runner_mod
from tests.engine.helpers import make_engine, random_prompt, run_to_completion
from tests.engine.test_equivalence import EXACT, max_logit_error

S, R, D, H = 12, 9, 16, 2


def _case(row_slots, seed):
    g = torch.Generator().manual_seed(seed)
    t = len(row_slots)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    ring = RingKeys(rnd(S, R, D), SlotRows.build(row_slots), torch.rand(t, R, generator=g) < 0.8)
    per_row = (rnd(t, 5, D), torch.rand(t, 5, generator=g) < 0.7)
    shared = (rnd(4, D), torch.rand(t, 4, generator=g) < 0.5)
    return rnd(t, H, D), [ring, per_row, shared], rnd(H)


@pytest.mark.parametrize("row_slots", [
    list(range(10)),                          # decodes in slot order: slices, direct runs
    [7, 2, 9, 0, 11, 4, 5],                   # decodes in any order, slots with gaps
    [3, 3, 8, 1, 1, 1, 6, 10, 10, 0],         # verification chunks: several rows per slot
])
def test_ring_attention_in_passes_equals_one_pass(monkeypatch, row_slots):
    q, groups, sink = _case(row_slots, len(row_slots))
    whole = ragged_union_attention(q, groups, sink, 0.25)        # every slot in one pass
    row_bytes = R * D * 8
    monkeypatch.setattr(ragged, "RING_PASS_BYTES", 2 * row_bytes)  # two slots per pass
    passes = ragged_union_attention(q, groups, sink, 0.25)
    assert len(groups[0].rows.split(2)) > 1
    assert torch.allclose(passes, whole, atol=1e-14, rtol=0)
    # the shared reference: per row, the padded union attention over its own keys
    ok_rows = torch.cat([groups[0].ok, groups[1][1], groups[2][1]], 1)
    for t, s in enumerate(row_slots):
        keys = torch.cat([groups[0].values[s], groups[1][0][t], groups[2][0]])
        want = ragged.union_attention(q[None, t:t + 1], [(keys[None], ok_rows[None, t:t + 1])], sink, 0.25)
        assert torch.allclose(passes[t], want[0, 0], atol=1e-13, rtol=0)


def test_quantize_values_is_the_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 512, generator=g) * torch.logspace(-30, 30, 300).unsqueeze(1)
    x[0] = 0
    for dtype in (torch.float32, torch.float64):
        q, values = mxfp8.quantize_values(x.to(dtype))
        assert torch.equal(q, mxfp8.quantize(x.to(dtype)))
        assert torch.equal(values, mxfp8.dequantize(q, dtype)) and values.dtype == dtype


def test_csa_skips_the_indexer_while_every_entry_fits_top_k(monkeypatch):
    cfg = small_test_config(csa_topk=8)             # csa_m 4: 32 tokens' entries fit top-k
    calls = []
    scores = runner_mod.ragged_indexer_scores
    monkeypatch.setattr(runner_mod, "ragged_indexer_scores",
                        lambda *a: calls.append(1) or scores(*a))
    engine = make_engine(cfg, num_slots=4)
    short = [engine.add_request(random_prompt(20, 40 + i), SamplingParams(temperature=0, max_tokens=8,
                                                                       ignore_eos=True)) for i in range(3)]
    run_to_completion(engine)                       # ends at 27 tokens: at most 6 entries
    assert calls == []
    long = engine.add_request(random_prompt(40, 50), SamplingParams(temperature=0, max_tokens=6))
    run_to_completion(engine)                       # 10+ entries: the indexer picks 8
    assert calls
    for seq in short + [long]:
        assert max_logit_error(engine, cfg, seq) <= EXACT
