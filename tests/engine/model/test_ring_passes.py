"""The CPU throughput paths compute the same numbers as the plain ones: the ring group through
torch's flash attention merged by log-sum-exp (kernels/ragged.py _ring_flash), MXFP8 quantize +
values in one pass, and CSA layers skipping the indexer when no row sees more than top-k
entries."""

import pytest
import torch

from kernels import mxfp8, ragged
from kernels.attention import union_attention
from kernels.ragged import RingKeys, SlotRows, ragged_union_attention
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import runner as runner_mod
from tests.engine.core.test_equivalence import EXACT, max_logit_error
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

S, R, D, H = 12, 9, 16, 2
F32_BOUND = 2e-6      # of the output's largest magnitude: fp32 sums in another order


def _case(row_slots, seed, dtype, n_row=5, n_shared=4):
    g = torch.Generator().manual_seed(seed)
    t = len(row_slots)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    ok = torch.rand(t, R, generator=g) < 0.8
    ok[0] = False                             # a row that sees no ring key
    ring = RingKeys(rnd(S, R, D), SlotRows.build(row_slots), ok)
    per_row = (rnd(t, n_row, D), torch.rand(t, n_row, generator=g) < 0.7)
    shared = (rnd(n_shared, D), torch.rand(t, n_shared, generator=g) < 0.5)
    per_row[1][-1], shared[1][-1], ok[-1] = False, False, False   # a row that sees only the sink
    return rnd(t, H, D), [ring, per_row, shared], rnd(H)


def _reference(q, groups, sink, row_slots):
    """Per row, the batched union attention over the row's own keys (its slot's whole ring,
    its per-row keys, the shared pool), the masks concatenated alike."""
    ring, *rest = groups
    ok = torch.cat([ring.ok, *(g[1] for g in rest)], 1)
    out = []
    for t, s in enumerate(row_slots):
        keys = torch.cat([ring.values[s], *(g[0][t] if g[0].dim() == 3 else g[0] for g in rest)])
        out.append(union_attention(q[None, t : t + 1], [(keys[None], ok[None, t : t + 1])], sink, 0.25)[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("row_slots", [
    list(range(10)),                          # decodes in slot order: the ring is a view
    [7, 2, 9, 0, 11, 4, 5],                   # decodes in any order, slots with gaps
    [3, 3, 8, 1, 1, 1, 6, 10, 10, 0],         # verification chunks: several rows per slot
    [11, 0, 0],                               # a range too sparse for a view: slots picked
])
@pytest.mark.parametrize("sizes", [(5, 4), (0, 4), (5, 0)], ids=["both", "no-row-keys", "no-pool"])
def test_ring_flash_equals_union_attention(row_slots, dtype, sizes):
    assert ragged._FLASH is not None           # this torch has the CPU flash kernel: it runs
    q, groups, sink = _case(row_slots, len(row_slots), dtype, *sizes)
    got = ragged_union_attention(q, groups, sink, 0.25)
    want = _reference(q, groups, sink, row_slots)
    plain = ragged._union(q, groups, sink, 0.25)   # the math off the CPU
    assert torch.all(got[-1] == 0)            # sink only: attends to nothing
    err = float((got - want).abs().max())
    if dtype == torch.float64:
        assert err <= 1e-12 and float((plain - want).abs().max()) <= 1e-12
    else:
        assert err <= F32_BOUND * float(want.abs().max()), err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", [(1,), (2,), (1, 2), (2, 1)], ids=["rows", "pool", "both", "pool-first"])
def test_flash_without_a_ring_takes_the_largest_group(dtype, which):
    # prefill windows: a shared pool (long chunk) or per-row gathered keys (short chunks),
    # with or without compressed entries beside them; the group with most keys goes flash
    row_slots = [1, 1, 1, 2, 5, 5]
    q, groups, sink = _case(row_slots, 11, dtype, n_row=7, n_shared=11)
    picked = [groups[i] for i in which]
    got = ragged_union_attention(q, picked, sink, 0.25)
    ok = torch.cat([g[1] for g in picked], 1)
    want = []
    for t in range(len(row_slots)):
        keys = torch.cat([g[0][t] if g[0].dim() == 3 else g[0] for g in picked])
        want.append(union_attention(q[None, t : t + 1], [(keys[None], ok[None, t : t + 1])], sink, 0.25)[0, 0])
    want = torch.stack(want)
    err = float((got - want).abs().max())
    assert err <= (1e-12 if dtype == torch.float64 else F32_BOUND * float(want.abs().max())), err
    assert torch.all(got[-1] == 0)            # the last row sees nothing: sink only


def test_ring_flash_ring_group_alone_and_every_row_masked():
    q, groups, sink = _case([4, 4, 5, 7], 9, torch.float64)
    ring = groups[0]
    for ok in (ring.ok, torch.zeros_like(ring.ok)):
        alone = RingKeys(ring.values, ring.rows, ok)
        got = ragged_union_attention(q, [alone], sink, 0.25)
        want = _reference(q, [alone], sink, [4, 4, 5, 7])
        assert float((got - want).abs().max()) <= 1e-12


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
