"""Bounded replay on DeepSeek V4's ledgers (docs/design.md §6): blocks cached, no snapshot.

The replay runs the last 128 tokens before the hit and the rest of the prompt as a fresh
window against the cached entries. It is approximate by design: these tests pin what it
reads and writes and its cost, and measure how far it lands from the exact cold run."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.ledgers import Ledgers, extend, replay
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
HIT = 256


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = tiny.stored_model("flash_geometry", tmp_path_factory.mktemp("flash_geometry"))
    cfg = model.cfg
    prompt = tiny.prompt("flash_geometry", seed=7).tolist()[:300]
    led = Ledgers(cfg, num_slots=2, num_blocks=8)
    cold = led.open()
    extend(model, led, cold, prompt[:HIT])
    cold_rows = extend(model, led, cold, prompt[HIT:])
    before = {i: t[cold.blocks[:2]].clone() for i, t in led.entries.items()}
    warm = led.open()
    led.share(warm, cold.blocks[: HIT // 128])
    rows = replay(model, led, warm, prompt, HIT)
    return model, led, cold, warm, prompt, cold_rows, rows, before


def test_replay_runs_the_last_block_and_the_rest_only(run):
    model, led, cold, warm, prompt, cold_rows, rows, _ = run
    assert rows.shape[0] == len(prompt) - (HIT - 128)        # not the whole prefix
    assert warm.length == len(prompt) and warm.blocks[:2] == cold.blocks[:2]


def test_cached_entries_are_read_never_rewritten(run):
    _, led, cold, _, _, _, _, before = run
    for i, t in led.entries.items():
        assert torch.equal(t[cold.blocks[:2]], before[i])


def test_replay_is_approximate_and_decodes_on(run):
    """On this random-weight model the truncated window moves the logits after the hit by up
    to ~0.3 (logits up to ~1): truncation is real. How much it costs a trained model is the
    replay-quality evaluation's question, not this test's."""
    model, led, cold, warm, prompt, cold_rows, rows, _ = run
    got = rows[-(len(prompt) - HIT):]                      # the rows after the hit
    err = (got - cold_rows).abs().max().item()
    print(f"bounded replay: max |logit - exact| = {err:.3g} "
          f"(logits up to {cold_rows.abs().max().item():.3g})")
    assert 0 < err < float("inf")
    nxt = [int(rows[-1].argmax())]
    assert extend(model, led, warm, nxt).shape[0] == 1     # the state it leaves decodes on


def test_a_replay_from_position_zero_is_the_exact_run(run):
    """With the hit at 128 the replay starts at 0: nothing is truncated, the cached entries
    are the ones it would compute, and the CSA overlap it rebuilds is the exact one, so it
    must land on the cold run (to the fp32 steps' rounding between chunkings)."""
    model, _, _, _, prompt, _, _, _ = run
    led = Ledgers(model.cfg, num_slots=2, num_blocks=8)
    cold = led.open()
    extend(model, led, cold, prompt[:128])
    want = extend(model, led, cold, prompt[128:])
    warm = led.open()
    led.share(warm, cold.blocks[:1])
    got = replay(model, led, warm, prompt, 128)[128:]
    assert (got - want).abs().max().item() <= 1e-6


def test_replay_refuses_what_it_cannot_do(run):
    model, led, cold, *_ = run
    seq = led.open() if led._free_slots else None
    assert seq is None                                     # both slots are held
    with pytest.raises(ValueError, match="replay: an empty sequence"):
        replay(model, led, cold, [1] * 300, 256)           # cold is not empty


@pytest.mark.parametrize("hit", [128, 256])
def test_replay_equals_the_independent_truncated_window_reference(run, hit):
    from tests.engine.deepseek_v4.replay_reference import truncated_window_logits
    model, _, _, _, prompt, _, _, _ = run
    led = Ledgers(model.cfg, num_slots=2, num_blocks=8)
    cold = led.open()
    extend(model, led, cold, prompt[:hit])
    warm = led.open()
    led.share(warm, cold.blocks[: hit // 128])
    got = replay(model, led, warm, prompt, hit)
    want = truncated_window_logits(model, prompt, hit)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6
