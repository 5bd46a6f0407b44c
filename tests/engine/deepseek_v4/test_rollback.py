"""Speculative rollback on DeepSeek V4's ledgers: up to 6 drafted tokens verified in one
forward, the rejected ones taken back; decoding on equals never having drafted them."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, extend, rollback
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
TOL = 1e-6    # a verify forward is one 7-row call where plain decoding makes 1-row calls


@pytest.fixture(scope="module", params=["flash_geometry", "topk_nested_yarn"])
def model(request, tmp_path_factory):
    return request.param, tiny.stored_model(request.param, tmp_path_factory.mktemp(request.param))


def _greedy(model, led, seq, first: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
    toks, rows = [first], []
    for _ in range(n):
        rows.append(extend(model, led, seq, toks[-1:]))
        toks.append(int(rows[-1][-1].argmax()))
    return toks, rows


@pytest.mark.parametrize("accepted", [0, 2, 6])
def test_rejected_drafts_leave_no_trace(model, accepted):
    """Draft 6 tokens: the first `accepted` are the greedy ones, the rest wrong. After the
    verify forward and the rollback, the next tokens equal plain greedy decoding."""
    name, m = model
    prompt = tiny.prompt(name).tolist()
    plain = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    seq = plain.open()
    first = int(extend(m, plain, seq, prompt)[-1].argmax())
    want_tokens, want_rows = _greedy(m, plain, seq, first, 16)

    led = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    s = led.open()
    extend(m, led, s, prompt)
    drafts = want_tokens[1:1 + accepted] + [(t + 1) % m.cfg.vocab_size
                                           for t in want_tokens[1 + accepted:7]]
    verify = extend(m, led, s, [first] + drafts)            # 7 rows: last token + 6 drafts
    assert verify[: accepted + 1].argmax(-1).tolist() == want_tokens[1:accepted + 2]
    rollback(led, s, len(prompt) + 1 + accepted)
    assert len(s.blocks) == -(-s.length // 128)
    got_tokens, got_rows = _greedy(m, led, s, want_tokens[accepted + 1], 8)
    assert got_tokens == want_tokens[accepted + 1:accepted + 10]
    err = (torch.cat(got_rows) - torch.cat(want_rows[accepted + 1:accepted + 9])).abs().max()
    assert err.item() <= TOL


def test_rollback_is_bounded_by_the_spare_rows(model):
    _, m = model
    led = Ledgers(m.cfg, num_slots=1, num_blocks=8)
    s = led.open()
    extend(m, led, s, list(range(20)))
    with pytest.raises(ValueError, match="only the last 6 of 20"):
        rollback(led, s, 13)
    rollback(led, s, 14)
    assert s.length == 14
