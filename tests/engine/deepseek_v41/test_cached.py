"""DeepSeek V4.1 in pieces (v41_cached.py) against the whole-sequence reference: chunked
prefill and decodes, and decoder-side truncation in both forms (float64, exact to 1e-9)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.v41_cached import SequenceState, extend
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v41 import tiny

EXACT = 1e-9


@pytest.fixture(scope="module", params=list(tiny.CONFIGS))
def model(request):
    cfg = tiny.config(request.param)
    return request.param, V41Model(cfg, tiny.weights(cfg), torch.float64)


def _run(m, ids, chunks, decodes, **truncation):
    """Prefill ids[:sum(chunks)] in `chunks`, then decode the rest one token at a time."""
    state, out, at = SequenceState(), [], 0
    for size in chunks:
        out.append(extend(m, state, ids[at:at + size], **truncation))
        at += size
    for _ in range(decodes):
        out.append(extend(m, state, ids[at:at + 1], **truncation))
        at += 1
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_prefill_and_decodes_compute_the_whole_sequence(model, chunk):
    name, m = model
    ids = tiny.prompt(name)
    decodes = 6
    prompt = len(ids) - decodes
    chunks = [chunk] * (prompt // chunk) + ([prompt % chunk] if prompt % chunk else [])
    got = _run(m, ids, chunks, decodes)
    assert (got - m.logits(ids)).abs().max() <= EXACT


@pytest.mark.parametrize("name", ["flash_like", "flash_geometry"])
def test_compact_and_mask_truncation_agree_and_keep_only_the_last_positions(name):
    cfg = tiny.config(name)
    m = V41Model(cfg, tiny.weights(cfg), torch.float64)
    ids = tiny.prompt(name)
    keep = cfg.window + 6
    compact = m.logits(ids, keep=keep)
    masked = m.logits(ids, keep=keep, mode="mask")
    assert compact.shape[0] == keep
    assert (compact - masked[-keep:]).abs().max() <= EXACT
    assert (m.logits(ids, keep=len(ids)) - m.logits(ids)).abs().max() <= EXACT
    # the approximation is real: decoder rows near the cut lose window rows below it
    assert (compact - m.logits(ids)[-keep:]).abs().max() > 1e-6


@pytest.mark.parametrize("mode", ["compact", "mask"])
@pytest.mark.parametrize("chunk", [5, 64])
def test_truncated_prefill_in_chunks_then_decodes_equal_the_truncated_reference(mode, chunk):
    """A prompt of P tokens prefilled with the decoder from P - KEEP, then decodes: every row
    past the cut equals the reference that runs the decoder on positions P - KEEP on."""
    name = "flash_like"
    cfg = tiny.config(name)
    m = V41Model(cfg, tiny.weights(cfg), torch.float64)
    ids = tiny.prompt(name)
    decodes, keep = 5, cfg.window + 6
    prompt = len(ids) - decodes
    cut = prompt - keep
    chunks = [chunk] * (prompt // chunk) + ([prompt % chunk] if prompt % chunk else [])
    got = _run(m, ids, chunks, decodes, decoder_from=cut, mode=mode)
    want = m.logits(ids, keep=len(ids) - cut)
    if mode == "mask":
        got = got[cut:]
    assert got.shape == want.shape
    assert (got - want).abs().max() <= EXACT


@pytest.mark.parametrize("name", ["flash_like", "flash_geometry"])
def test_bounded_replay_after_a_block_hit_equals_the_truncated_window_reference(name):
    """A hit at a 128-token boundary restores entries and keys, no windows: the last 128
    tokens before it run again (their entries from the cache), then the prompt's rest."""
    from kvmesh.services.engine.model.deepseek_v4.v41_cached import replay_state
    from tests.engine.deepseek_v41.replay_reference import truncated_window_logits
    cfg = tiny.config(name)
    m = V41Model(cfg, tiny.weights(cfg), torch.float64)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 100, (300,), generator=g).tolist()
    hit = 256 if name == "flash_geometry" else 128
    exact = SequenceState()
    extend(m, exact, prompt[:hit])
    state = replay_state(cfg, exact, hit)
    got = torch.cat([extend(m, state, prompt[hit - 128:hit]), extend(m, state, prompt[hit:])])
    want = truncated_window_logits(m, prompt, hit)
    assert got.shape == want.shape == (len(prompt) - hit + 128, cfg.vocab_size)
    assert (got - want).abs().max() <= EXACT
    cold = m.logits(torch.tensor(prompt))[hit - 128:]
    if cfg.window == 128:   # the windows reach below the replay: an approximation
        assert (got - cold).abs().max() > 1e-6
    else:                   # every layer's window rebuilt long before `hit`: exact from there
        assert (got[-(len(prompt) - hit):] - cold[-(len(prompt) - hit):]).abs().max() <= EXACT
