"""bench/quality/v41_harness.py forces a continuation through Engine's own decode rows. Pinned in
float64 against the whole-sequence reference (V41Model.logits, with the prompt's decoder
cut under truncation): cold off and compact, a snapshot hit (exact), and a bounded replay
(its replay is what differs, so only its shape and counters are pinned)."""

from __future__ import annotations

import pytest
import torch

from bench.quality.forcing import Req, forced
from bench.quality.v41_harness import make_engine, run
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import random_prompt, word_tokenizer
from tests.engine.deepseek_v41 import tiny

L, N, KEEP = 400, 12, 134
EXACT = 1e-10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvmesh.services.engine.build import v4_tokenizer

    directory = tmp_path_factory.mktemp("v41-harness")
    cfg, meant = tiny.save_release("flash_geometry", directory, quantized=False, shards=1)
    word_tokenizer(directory)
    model = V41Model(cfg, meant, torch.float64)
    return model, v4_tokenizer(directory, cfg)


def reference(model: V41Model, prompt: list[int], cont: list[int], keep: int | None):
    """Rows L-1 .. L+N-2 of the whole sequence (the last N rows it returns), the decoder on
    the prompt's last `keep` positions and every later one."""
    ids = torch.tensor(prompt + cont[:-1])
    cut_keep = None if keep is None else len(ids) - (len(prompt) - keep)
    return model.logits(ids, keep=cut_keep)[-len(cont):]


def engine(setup, **ecfg):
    model, tok = setup
    return make_engine(model, tok, 4, L + N, 64, **ecfg)


@pytest.mark.parametrize("truncation", ["off", "compact"])
def test_a_cold_forced_continuation_equals_the_reference(setup, truncation):
    model, _ = setup
    prompt, cont = random_prompt(L, 3), random_prompt(N, 4)
    keep = KEEP if truncation == "compact" else None
    got = run(engine(setup, truncation=truncation, keep_tokens=KEEP),
              [forced("f", prompt, cont, "s"), Req("g", prompt, "t", greedy=N)])
    assert got["f"].tokens == cont                   # the continuation was fed back
    assert got["f"].logits.shape == (N, model.cfg.vocab_size)
    assert (got["f"].logits - reference(model, prompt, cont, keep)).abs().max() < EXACT
    greedy = reference(model, prompt, got["g"].tokens, keep).argmax(-1).tolist()
    assert greedy == got["g"].tokens                 # free-running greedy, unforced


def test_a_snapshot_hit_equals_cold_and_a_replay_is_counted(setup):
    model, _ = setup
    prompt, cont = random_prompt(L, 5), random_prompt(N, 6)
    ref = reference(model, prompt, cont, KEEP)
    l1 = (L - KEEP) // 128 * 128                     # the deepest boundary before the cut
    for policy, replayed in (("full", 0), ("zero", 128)):
        eng = engine(setup, truncation="compact", keep_tokens=KEEP, swa_policy=policy)
        run(eng, [Req("w", prompt, "s", greedy=1)])
        hit = run(eng, [forced("f", prompt, cont, "s")])["f"]
        assert (hit.cached, hit.replayed, hit.snapshot_hit) == (l1, replayed, policy == "full")
        diff = (hit.logits - ref).abs().max()
        if policy == "full":
            assert diff < EXACT
        else:      # the replay's window is approximate: close, but not the same rows
            assert 0 < diff < 1.0


def test_float32_results_do_not_depend_on_the_chunking(setup, tmp_path):
    """MXFP8 window rows (float32): a chunk's rows attend each other rounded as the ring
    keeps them, so prefilling in chunks of 7 or of 256 and decoding give the same logits to
    float32 noise, and n-gram verification (several rows a step) the same greedy tokens as
    plain decoding (unrounded in-chunk rows: 3e-4 apart here, 0.1 on the shipped model)."""
    from kvmesh.services.engine.model.deepseek_v4 import window_rows

    reference, tok = setup
    cfg, w64 = reference.cfg, reference.weights
    w = {k: v.float() if v.is_floating_point() else v for k, v in w64.items()}
    model = V41Model(cfg, w, torch.float32, rows=window_rows.for_dtype(torch.float32))
    prompt, cont = random_prompt(L, 12), random_prompt(N, 13)
    got = {chunk: run(make_engine(model, tok, 2, L + N, chunk, truncation="off"),
                      [forced("f", prompt, cont, "s")])["f"].logits for chunk in (7, 256)}
    assert (got[7] - got[256]).abs().max() < 3e-5
    for method in ("off", "ngram:4"):
        eng = make_engine(model, tok, 2, 2 * L, 64, speculative=method, spec_policy="always")
        out = run(eng, [Req("g", prompt[:100] * 3, "t", greedy=24)])["g"].tokens
        if method == "off":
            plain = out
    assert out == plain and eng.stats()["spec_drafted_tokens"] > 0
    unrounded = V41Model(cfg, w, torch.float32)       # refused: it would depend on chunking
    with pytest.raises(ValueError, match="must round its fresh rows"):
        run(make_engine(unrounded, tok, 2, L + N, 64), [Req("g", prompt, "t", greedy=1)])
