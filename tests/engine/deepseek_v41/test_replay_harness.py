"""bench/_replay_v41.py forces a continuation through V4Engine's own decode rows. Pinned in
float64 against the whole-sequence reference (V41Model.logits, with the prompt's decoder
cut under truncation): cold off and compact, a snapshot hit (exact), and a bounded replay
(its replay is what differs, so only its shape and counters are pinned)."""

from __future__ import annotations

import pytest
import torch

from bench._replay_engine import Req, forced
from bench._replay_v41 import make_engine, run
from services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import random_prompt, word_tokenizer
from tests.engine.deepseek_v41 import tiny

L, N, KEEP = 400, 12, 134
EXACT = 1e-10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from services.engine.build import v4_tokenizer

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
