"""DeepSeek V4 through the two ledgers (state slots, paged blocks): the byte layout is the one
`kvmesh engine layout` prints, and a sequence run from its ledger bytes alone computes what
the in-memory pieces and the full forward compute with the same storage roundings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import layout
from kvmesh.services.engine.model.deepseek_v4.cached import SequenceCache
from kvmesh.services.engine.model.deepseek_v4.cached import extend as extend_in_memory
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint
from kvmesh.services.engine.model.deepseek_v4.config import read_config
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, SlotLayout, extend
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4-flash.json"
SAME = 1e-12     # float64: the same numbers read back from the ledgers
TOL = 1e-6


@pytest.mark.parametrize("extra_state", [False, True])
def test_flash_slot_regions_are_what_layout_prints(extra_state):
    cfg = read_config(FLASH)
    slot = SlotLayout(cfg, extra_state)
    rep = layout.report(cfg, extra_state)["state_slot"]
    assert slot.slot_bytes == rep["bytes"]
    ends = [r.offset + r.nbytes for r in slot.regions]
    assert [r.offset for r in slot.regions[1:]] == ends[:-1]            # contiguous
    swa = [r for r in slot.regions if r.name == "swa"]
    assert len(swa) == 43 and {r.shape for r in swa} == {(396 if extra_state else 134, 528)}
    assert sum(r.nbytes for r in swa) == rep["swa_bytes"]
    cmp_csa = next(r for r in slot.regions if r.name == "cmp" and r.layer == 2)
    assert cmp_csa.shape == (14, 2, 1024) and cmp_csa.dtype == "float32"


@pytest.fixture(scope="module", params=["flash_geometry", "topk_nested_yarn"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    tiny.save(request.param, directory)
    cfg, weights = load_checkpoint(directory, torch.float64)
    return request.param, V4Model(cfg, weights, torch.float64, stored=True)


def test_block_bytes_match_the_layout(model):
    _, m = model
    led = Ledgers(m.cfg, num_slots=2, num_blocks=4)
    assert led.block_bytes() == layout.report(m.cfg)["block"]["bytes"]


def _run(step, prompt, chunk, decode=10):
    rows = [step(prompt[s:s + chunk]) for s in range(0, len(prompt), chunk)]
    tokens = list(prompt)
    for _ in range(decode):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(step(tokens[-1:]))
    return torch.cat(rows), tokens


@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_a_sequence_from_its_ledger_bytes_equals_the_pieces_and_the_full_forward(model, chunk):
    name, m = model
    prompt = tiny.prompt(name).tolist()
    led = Ledgers(m.cfg, num_slots=2, num_blocks=8)
    seq = led.open()
    got, tokens = _run(lambda ids: extend(m, led, seq, ids), prompt, chunk)
    assert len(seq.blocks) == -(-len(tokens) // 128)
    cache = SequenceCache()
    want, same_tokens = _run(lambda ids: extend_in_memory(m, cache, ids), prompt, chunk)
    assert same_tokens == tokens
    assert (got - want).abs().max().item() <= SAME
    full = m.logits(torch.tensor(tokens))
    assert (got - full).abs().max().item() <= max(TOL, (want - full).abs().max().item() + SAME)


def test_sequences_in_other_slots_do_not_disturb_each_other(model):
    name, m = model
    a, b = tiny.prompt(name, seed=1).tolist(), tiny.prompt(name, seed=2).tolist()
    led = Ledgers(m.cfg, num_slots=2, num_blocks=8)
    sa, sb = led.open(), led.open()
    rows_a, rows_b = [], []
    for s in range(0, len(a), 37):                          # interleaved chunks
        rows_a.append(extend(m, led, sa, a[s:s + 37]))
        rows_b.append(extend(m, led, sb, b[s:s + 37]))
    alone = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    sc = alone.open()
    want = torch.cat([extend(m, alone, sc, a[s:s + 37]) for s in range(0, len(a), 37)])
    assert torch.equal(torch.cat(rows_a), want)
    led.close(sa)
    assert sa.blocks == [] and led.pool.num_free == 8 - len(sb.blocks)


def test_the_ledger_path_needs_the_stored_model(model):
    _, m = model
    plain = V4Model(m.cfg, m.weights, torch.float64)
    led = Ledgers(m.cfg, num_slots=1, num_blocks=2)
    with pytest.raises(ValueError, match="stored=True"):
        extend(plain, led, led.open(), [1, 2])


def test_batched_decode_of_eight_beside_a_prefill_chunk_equals_each_alone(model):
    """8 sequences decode in the same steps as a 9th one's prompt is prefilled in chunks of
    16; every sequence's logits equal its run alone (same chunks) to the fp32 steps'
    rounding, which now sees 8 + 16 rows instead of 1, and its greedy tokens are the same."""
    from kvmesh.services.engine.model.deepseek_v4.ledgers import step
    name, m = model
    prompts = [tiny.prompt(name, seed=10 + k).tolist()[: 20 + 3 * k] for k in range(8)]
    long_prompt = tiny.prompt(name, seed=99).tolist()[:64]
    led = Ledgers(m.cfg, num_slots=9, num_blocks=9 * 4)
    seqs = [led.open() for _ in range(8)]
    batched = [[extend(m, led, s, p)] for s, p in zip(seqs, prompts, strict=True)]
    tokens = [list(p) for p in prompts]
    late, late_rows = led.open(), []
    for r in range(4):
        works = [(s, [int(rows[-1][-1].argmax())]) for s, rows in zip(seqs, batched, strict=True)]
        for (_, t), toks in zip(works, tokens, strict=True):
            toks += t
        works.append((late, long_prompt[16 * r:16 * r + 16]))
        out = step(m, led, works)
        for rows, o in zip(batched, out[:8], strict=True):
            rows.append(o)
        late_rows.append(out[-1])
    for k in range(8):
        alone = Ledgers(m.cfg, num_slots=1, num_blocks=4)
        s = alone.open()
        want = [extend(m, alone, s, prompts[k])] + [extend(m, alone, s, [t])
                                                    for t in tokens[k][len(prompts[k]):]]
        got = torch.cat(batched[k])
        assert (got - torch.cat(want)).abs().max().item() <= TOL
        assert got.argmax(-1).tolist() == torch.cat(want).argmax(-1).tolist()
    alone = Ledgers(m.cfg, num_slots=1, num_blocks=4)
    s = alone.open()
    want = torch.cat([extend(m, alone, s, long_prompt[i:i + 16]) for i in range(0, 64, 16)])
    assert (torch.cat(late_rows) - want).abs().max().item() <= TOL


def test_a_step_refuses_a_sequence_twice_and_empty_work(model):
    from kvmesh.services.engine.model.deepseek_v4.ledgers import step
    _, m = model
    led = Ledgers(m.cfg, num_slots=2, num_blocks=4)
    s = led.open()
    with pytest.raises(ValueError, match="appears twice"):
        step(m, led, [(s, [1]), (s, [2])])
    with pytest.raises(ValueError, match=r"works\[1\].ids"):
        step(m, led, [(s, [1]), (led.open(), [])])
