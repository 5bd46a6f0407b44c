"""The model over a sequence in pieces (`cached.extend`) against the full forward: chunked
prefill at chunk sizes 1, 7, 64 and 300, then greedy one-token decodes, in float64.

The fp32 steps the reference keeps in a float64 model (the hyper-connections' projection
above all) round differently when a CPU GEMM is given 1 row instead of 300, so a chunked run
can differ from the one-pass forward by a few 1e-7 (up to 7.7e-7 seen here). transformers'
own cached forward differs from its one-pass forward by exactly as much: the test holds the
pieces equal to transformers' cached forward run with the same chunks, and their distance
from the full forward to 1e-6 or, where the rounding takes transformers further, to its own.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.cached import SequenceCache, extend
from kvmesh.services.engine.model.deepseek_v4.score import load_model
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
SAME = 1e-9      # float64: the same steps as transformers' cached forward
TOL = 1e-6       # from the one-pass forward (the fp32 steps' rounding), or transformers' own
DECODE = 12


@pytest.fixture(scope="module", params=["flash_geometry", "mixed", "topk_nested_yarn"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = tiny.save(request.param, directory).double()
    return request.param, load_model(directory, torch.float64), hf


def _hf_in_chunks(hf, tokens: list[int], pieces: list[int]) -> torch.Tensor:
    from transformers import DynamicCache
    cache, rows, start = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in pieces:
            ids = torch.tensor(tokens[start:start + n]).view(1, -1)
            rows.append(hf(ids, past_key_values=cache, use_cache=True).logits[0])
            start += n
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_chunked_prefill_then_decode_equals_the_full_forward(model, chunk):
    name, m, hf = model
    prompt = tiny.prompt(name).tolist()
    cache, rows = SequenceCache(), []
    for start in range(0, len(prompt), chunk):
        rows.append(extend(m, cache, prompt[start:start + chunk]))
    tokens = list(prompt)
    for _ in range(DECODE):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(extend(m, cache, tokens[-1:]))
    got = torch.cat(rows)
    assert cache.length == len(tokens) == got.shape[0]
    hf_chunked = _hf_in_chunks(hf, tokens, [r.shape[0] for r in rows])
    assert (got - hf_chunked).abs().max().item() <= SAME
    full = m.logits(torch.tensor(tokens))
    with torch.no_grad():
        hf_full = hf(torch.tensor(tokens).view(1, -1), use_cache=False).logits[0]
    own = (hf_chunked - hf_full).abs().max().item()
    assert (got - full).abs().max().item() <= max(TOL, own + SAME)
    assert got.argmax(-1).tolist() == full.argmax(-1).tolist()


def test_the_cache_keeps_a_window_and_compressor_state_not_the_sequence(model):
    name, m, _ = model
    prompt = tiny.prompt(name).tolist()
    cache = SequenceCache()
    extend(m, cache, prompt)
    for i, parts in enumerate(cache.layers):
        assert parts.window_kv.shape[0] == min(len(prompt), m.cfg.window - 1)
        rate = m.cfg.rate(i)
        if rate:
            assert parts.pooled.entries.shape[0] == len(prompt) // rate
            assert parts.pooled.open_kv.shape[0] == len(prompt) % rate


def test_empty_extend_is_refused(model):
    with pytest.raises(ValueError, match="ids"):
        extend(model[1], SequenceCache(), [])
