"""Several DeepSeek V4 sequences decoding in one step attend together (decode.py): each row
computes what it computes alone, for sequences of different lengths (windows not yet full and
full, no compressed entry yet and several, indexer choices among few and many entries),
beside a prefill chunk, in float64 with exact rows: to 1e-6, as V4's reference keeps some
reductions in fp32 even in a float64 model (to match transformers), and those see 5 rows
summed in another order than 1; the greedy tokens are the same."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import forward
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, extend, step
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
TOL = 1e-6
DECODES = 6


@pytest.fixture(scope="module", params=["mixed", "topk_nested_yarn"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    tiny.save(request.param, directory)
    cfg, weights = load_checkpoint(directory, torch.float64)
    return request.param, V4Model(cfg, weights, torch.float64, stored=True, rows="exact")


def _alone(m, ids):
    led = Ledgers(m.cfg, num_slots=1, num_blocks=4, rows="exact")
    seq = led.open()
    extend(m, led, seq, ids[:-DECODES])
    return torch.cat([extend(m, led, seq, ids[k:k + 1])
                      for k in range(len(ids) - DECODES, len(ids))])


def test_decode_rows_of_different_lengths_in_one_step_equal_each_alone(model, monkeypatch):
    name, m = model
    calls = []
    real = forward.decode_rows
    monkeypatch.setattr(forward, "decode_rows", lambda *a: calls.append(1) or real(*a))
    full = tiny.CONFIGS[name][1]
    prompts = [tiny.prompt(name, seed=10 + k).tolist()[:n]
               for k, n in enumerate([DECODES + 1, DECODES + 5, full // 2, full])]
    led = Ledgers(m.cfg, num_slots=5, num_blocks=20, rows="exact")
    seqs = [led.open() for _ in prompts]
    for seq, ids in zip(seqs, prompts, strict=True):
        extend(m, led, seq, ids[:-DECODES])
    other, beside = led.open(), tiny.prompt(name, seed=50).tolist()
    got = [[] for _ in prompts]
    for t in range(DECODES):
        works = [(seq, ids[len(ids) - DECODES + t:len(ids) - DECODES + t + 1])
                 for seq, ids in zip(seqs, prompts, strict=True)]
        outs = step(m, led, works + [(other, beside[5 * t:5 * t + 5])])
        for k in range(len(prompts)):
            got[k].append(outs[k])
    assert calls, "the batched decode path did not run"
    for ids, rows in zip(prompts, got, strict=True):
        got, want = torch.cat(rows), _alone(m, ids)
        assert (got - want).abs().max().item() <= TOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))
