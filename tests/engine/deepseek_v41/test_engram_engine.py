"""A DeepSeek V4.1 model with Engram layers through the engine's ledgers and the Engine:
every cache path against the whole-sequence reference in float64. The ledgers keep no
tokens: each step is handed the few tokens before its chunks (`before`), which an n-gram
reads back into, so a chunk boundary, a snapshot, a replay, a handoff or a rollback must
hand over the right ones."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import snapshots, v41_snapshots
from kvmesh.services.engine.model.deepseek_v4.ledgers import rollback
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_ledgers import V41Ledgers, replay, step
from tests.engine.deepseek_v4.test_engine import engine, random_prompt
from tests.engine.deepseek_v41 import tiny
from tests.engine.deepseek_v41.replay_reference import truncated_window_logits
from tests.engine.deepseek_v41.test_engine import greedy, run

EXACT = 1e-9
# flash_geometry's layers: 1 and 2 are KV sources, 2 the first decoder layer; Engram on both
NAME = "flash_geometry"
ENGRAM = tiny.engram_fields([1, 2])


@pytest.fixture(scope="module")
def m():
    cfg = tiny.config(NAME, **ENGRAM)
    return V41Model(cfg, tiny.weights(cfg, dtype=torch.float64), torch.float64)


def _ledgers(m, slots=3, blocks=16, **kw):
    return V41Ledgers(m.cfg, slots, blocks, rows="exact", dtype=m.dtype, **kw)


def _step(m, led, seq, ids: list[int], chunk: list[int], cut=None, mode="compact"):
    """Run `chunk`, the tokens of `ids` from seq.length on, handing over the two before."""
    return step(m, led, [(seq, chunk)], [cut], mode, before=[ids[:seq.length][-2:]])[0]


def test_a_step_without_the_tokens_before_is_refused(m):
    led = _ledgers(m)
    with pytest.raises(ValueError, match="an Engram model needs the tokens preceding"):
        step(m, led, [(led.open(), [1, 2, 3])])


@pytest.mark.parametrize("chunk", [1, 9, 1000])
def test_chunks_and_decodes_compute_the_whole_sequence(m, chunk):
    ids = tiny.prompt(NAME).tolist()
    led = _ledgers(m)
    seq, out = led.open(), []
    while seq.length < len(ids) - 3:
        n = min(chunk, len(ids) - 3 - seq.length)
        out.append(_step(m, led, seq, ids, ids[seq.length:seq.length + n]))
    while seq.length < len(ids):
        out.append(_step(m, led, seq, ids, ids[seq.length:seq.length + 1]))
    assert (torch.cat(out) - m.logits(torch.tensor(ids))).abs().max() <= EXACT


def test_decode_rows_of_several_sequences_each_read_their_own_history(m):
    a, b, c = (tiny.prompt(NAME, seed=s).tolist()[:n] for s, n in ((2, 150), (3, 140), (4, 9)))
    led = _ledgers(m)
    seqs = [led.open() for _ in range(3)]
    for seq, ids in zip(seqs, (a, b, c), strict=True):
        _step(m, led, seq, ids, ids[:-1])
    outs = step(m, led, [(s, ids[-1:]) for s, ids in zip(seqs, (a, b, c), strict=True)],
                before=[ids[:-1][-2:] for ids in (a, b, c)])
    for out, ids in zip(outs, (a, b, c), strict=True):
        assert (out - m.logits(torch.tensor(ids))[-1:]).abs().max() <= EXACT


def test_rolled_back_drafts_leave_no_trace_in_the_ngrams(m):
    ids = tiny.prompt(NAME).tolist()[:60]
    led = _ledgers(m)
    seq = led.open()
    _step(m, led, seq, ids, ids[:31])
    _step(m, led, seq, ids, [3, 1, 4, 1, 5, 9])             # drafts, all rejected
    rollback(led, seq, 31)
    got = _step(m, led, seq, ids, ids[31:])
    assert (got - m.logits(torch.tensor(ids))[31:]).abs().max() <= EXACT


def test_a_replay_reads_the_tokens_before_its_128(m):
    prompt = random_prompt(300, 5)
    led = _ledgers(m)
    cold = led.open()
    _step(m, led, cold, prompt, prompt)
    warm = led.open()
    led.share(warm, cold.blocks[:2])
    got = replay(m, led, warm, prompt, 256)
    assert (got - truncated_window_logits(m, prompt, 256)).abs().max() <= EXACT


def test_a_snapshot_hit_under_truncation_resumes_exactly(m):
    ids = tiny.prompt(NAME).tolist()            # 300 tokens; the decoder cut at 166
    cut = len(ids) - (m.cfg.window + 6)
    led = _ledgers(m)
    cold = led.open()
    _step(m, led, cold, ids, ids[:128], cut)
    snap = v41_snapshots.take(led, cold)
    want = _step(m, led, cold, ids, ids[128:], cut)
    warm = led.open()
    led.share(warm, cold.blocks[:1])
    v41_snapshots.restore(led, warm, snap)
    assert torch.equal(_step(m, led, warm, ids, ids[128:], cut), want)
    assert (want - m.logits(torch.tensor(ids), keep=len(ids) - cut)).abs().max() <= EXACT


def test_a_handoff_decodes_as_one_engine(m):
    ids = tiny.prompt(NAME).tolist()[:60]
    prefill, decode = _ledgers(m, extra_state=True), _ledgers(m)
    seq = prefill.open()
    _step(m, prefill, seq, ids, ids[:40])
    moved = snapshots.hand_off(prefill, seq, decode)
    out = [_step(m, decode, moved, ids, ids[i:i + 1]) for i in range(40, len(ids))]
    assert (torch.cat(out) - m.logits(torch.tensor(ids))[40:]).abs().max() <= EXACT


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engram")
    cfg, meant = tiny.save_release(NAME, directory, quantized=False, shards=1, **ENGRAM)
    return directory, V41Model(cfg, meant, torch.float64)


def test_the_engine_serves_greedy_tokens_batched_and_in_chunks(saved):
    directory, model = saved
    prompts = [random_prompt(n, seed) for n, seed in ((40, 2), (170, 3), (9, 4))]
    got = run(engine(directory, "--max-batched-tokens", "64", "--long-prefill-chunk", "7"),
              prompts, 12)
    assert got == [greedy(model, p, 12) for p in prompts]


def test_the_engine_hits_its_snapshot_and_speculates_with_engram(saved):
    directory, model = saved
    prompt = random_prompt(150, 6) * 2          # repeats: the n-gram drafter proposes
    core = engine(directory, "--truncation", "compact", "--keep-tokens", "134",
                  "--speculative", "ngram:3")
    first, again = run(core, [prompt], 12), run(core, [prompt], 12)
    stats = core.stats()
    assert stats["snapshot_hits"] == 1 and 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert first == again == [greedy(model, prompt, 12, keep=134)]
