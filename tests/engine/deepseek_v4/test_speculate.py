"""Greedy speculative decoding on DeepSeek V4's ledgers with the engine's n-gram drafter:
the same tokens as plain greedy decoding, with drafts both accepted and rejected (a random
model repeats itself, so every other step also drafts one token it cannot pick)."""

from __future__ import annotations

import pytest

from kvmesh.services.engine.core.speculative import NgramDrafter
from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, extend
from kvmesh.services.engine.model.deepseek_v4.speculate import verify_greedy
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
NEW = 40


@pytest.fixture(scope="module", params=["flash_geometry", "mixed"])
def model(request, tmp_path_factory):
    return request.param, tiny.stored_model(request.param, tmp_path_factory.mktemp(request.param))


def test_ngram_speculation_decodes_what_greedy_decodes(model):
    name, m = model
    prompt = (tiny.prompt(name).tolist()[:24]) * 3          # repeats: the drafter finds matches
    plain = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    seq = plain.open()
    want = [int(extend(m, plain, seq, prompt)[-1].argmax())]
    while len(want) < NEW:
        want.append(int(extend(m, plain, seq, want[-1:])[-1].argmax()))

    led = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    s = led.open()
    got = [int(extend(m, led, s, prompt)[-1].argmax())]
    drafter, accepted, rejected, forwards = NgramDrafter(1, 4), 0, 0, 0
    while len(got) < NEW:
        drafts = drafter.propose(prompt + got, 6)
        if forwards % 2:       # every other step also drafts a token the model will not pick
            drafts = drafts[:5] + [(drafts[-1] + 1) % m.cfg.vocab_size if drafts else 0]
        step = verify_greedy(m, led, s, got[-1], drafts)
        forwards += 1
        accepted += len(step) - 1
        rejected += len(drafts) - (len(step) - 1)
        got += step
    assert got[:NEW] == want
    assert accepted > 0 and rejected > 0 and forwards < NEW - 1
    assert s.length == len(prompt) + len(got) - 1


def test_more_drafts_than_the_rollback_are_refused(model):
    _, m = model
    led = Ledgers(m.cfg, num_slots=1, num_blocks=4)
    s = led.open()
    extend(m, led, s, [1, 2, 3])
    with pytest.raises(ValueError, match="at most 6"):
        verify_greedy(m, led, s, 4, [1] * 7)
