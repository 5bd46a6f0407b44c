"""The engine serving a DeepSeek V4.1 checkpoint (Engine over V4.1's ledgers, built by
`--model DIR`) against greedy decoding with the whole-sequence reference, in float64: one
sequence at several chunk sizes, batched requests, prefill truncation in both forms, a
prefix hit (snapshot under truncation, the bounded replay without), and n-gram speculation
with rejected drafts."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import engine, random_prompt, word_tokenizer
from tests.engine.deepseek_v4.test_engine import run as run_v4
from tests.engine.deepseek_v41 import tiny

TOKENS = 24


def run(core: Engine, prompts: list[list[int]], n: int = TOKENS) -> list[list[int]]:
    return run_v4(core, prompts, n)      # the V4 tests' loop, with this file's token count


def greedy(m: V41Model, prompt: list[int], n: int = TOKENS, keep: int | None = None) -> list[int]:
    """The reference's greedy continuation: the whole sequence re-run for every token, the
    decoder on the prompt's last `keep` positions and every later one (truncation)."""
    ids, out = list(prompt), []
    for _ in range(n):
        cut_keep = None if keep is None else len(ids) - (len(prompt) - keep)
        logits = m.logits(torch.tensor(ids), keep=cut_keep)
        out.append(int(logits[-1].argmax()))
        ids.append(out[-1])
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v41")
    cfg, meant = tiny.save_release("flash_geometry", directory, quantized=False, shards=1)
    word_tokenizer(directory)
    return directory, V41Model(cfg, meant, torch.float64)


@pytest.mark.parametrize("chunk", ["7", "64", "1000"])
def test_greedy_equals_the_reference(saved, chunk):
    directory, m = saved
    prompt = random_prompt(150, 1)
    core = engine(directory, "--long-prefill-chunk", chunk)
    assert core.cfg.model_type == "deepseek_v41"
    assert run(core, [prompt]) == [greedy(m, prompt)]


def test_requests_batched_in_steps_each_get_their_own_greedy_tokens(saved):
    directory, m = saved
    prompts = [random_prompt(n, seed) for n, seed in ((40, 2), (170, 3), (9, 4))]
    got = run(engine(directory, "--max-batched-tokens", "64"), prompts)
    assert got == [greedy(m, p) for p in prompts]


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_truncation_runs_the_decoder_on_the_last_keep_tokens(saved, mode):
    directory, m = saved
    prompt = random_prompt(300, 5)
    core = engine(directory, "--truncation", mode, "--keep-tokens", "134",
                  "--long-prefill-chunk", "64")
    assert run(core, [prompt]) == [greedy(m, prompt, keep=134)]
    # the two references really differ: the check above tells truncation from none
    ids = torch.tensor(prompt)
    assert (m.logits(ids, keep=134)[-1] - m.logits(ids)[-1]).abs().max() > 1e-6


def test_a_prefix_hit_under_truncation_restores_the_snapshot_exactly(saved):
    directory, m = saved
    prompt = random_prompt(300, 6)
    core = engine(directory, "--truncation", "compact", "--keep-tokens", "134")
    first = run(core, [prompt])
    again = run(core, [prompt])
    stats = core.stats()
    assert stats["snapshot_hits"] == 1 and stats["cache_hit_tokens"] == 128   # capped at the cut
    assert first == again == [greedy(m, prompt, keep=134)]


def test_a_replayed_prompt_leaves_its_snapshot_for_the_next_request(saved):
    """Truncation, policy full: a prompt sharing 2 blocks with an earlier one, but no window,
    replays at 256. Under `--replay-blocks share` the replay stops at the prompt's own
    snapshot boundary (384, the one before its cut at 416), stores the window there and
    prefills the rest in chunks: the same tokens as a replay run to the end in one forward
    (what `isolate`, which leaves no snapshot, does), and a prompt extending it then restores
    that window instead of replaying again."""
    directory, _ = saved
    shared, mine = random_prompt(300, 8), random_prompt(250, 9)
    other = shared + random_prompt(250, 10)              # its window lands at 384, not 256
    outputs = {}
    for blocks in ("share", "isolate"):
        core = engine(directory, "--truncation", "compact", "--keep-tokens", "134",
                      "--long-prefill-chunk", "64", "--replay-blocks", blocks)
        run(core, [other])
        outputs[blocks] = run(core, [shared + mine])    # 550 tokens: hit 256, replay 128
        stats = core.stats()
        assert (stats["snapshot_misses"], stats["replayed_tokens"]) == (1, 128)
        assert stats["computed_tokens"] == 2 * TOKENS - 2 + 550 + (550 - 256 + 128)
        assert stats["snapshot_stores"] == (2 if blocks == "share" else 1), blocks
        if blocks == "share":
            run(core, [shared + mine + random_prompt(100, 11)])  # cut 516: 4 blocks cached
            after = core.stats()
            assert (after["snapshot_hits"], after["cache_hit_tokens"]) == (1, 256 + 384)
            assert after["replayed_tokens"] == 128                   # no second replay
    assert outputs["share"] == outputs["isolate"] and len(outputs["share"][0]) == TOKENS


def test_a_snapshot_more_than_a_block_behind_the_hit_is_not_restored(saved):
    """The design's search range [L1 - W, L1]: under periodic:4 the first prompt's only
    snapshot is at 512, its blocks reach 896; a prompt extending it replays the last
    block before 896 instead of restoring 512 and recomputing 384 tokens more."""
    directory, _ = saved
    first = random_prompt(1000, 12)
    core = engine(directory, "--truncation", "compact", "--keep-tokens", "134",
                  "--swa-policy", "periodic:4")
    run(core, [first])
    assert core.stats()["snapshot_stores"] == 1               # at 512: (1000 - 134) // 512
    run(core, [first + random_prompt(400, 13)])
    stats = core.stats()
    assert (stats["snapshot_hits"], stats["snapshot_misses"]) == (0, 1)
    assert stats["replayed_tokens"] == 128 and stats["cache_hit_tokens"] >= 896


def test_a_prefix_hit_without_truncation_replays(saved):
    directory, m = saved
    prompt = random_prompt(300, 7)
    core = engine(directory)
    first = run(core, [prompt])
    again = run(core, [prompt])
    stats = core.stats()
    assert stats["snapshot_hits"] == 0 and stats["snapshot_misses"] == 1
    assert stats["replayed_tokens"] == 128
    assert first == [greedy(m, prompt)]
    assert len(again[0]) == TOKENS          # approximate by design (docs/design.md §3)


def test_ngram_speculation_takes_back_rejected_drafts(saved):
    directory, m = saved
    prompt = random_prompt(60, 8) * 2         # repeats: the n-gram drafter proposes
    core = engine(directory, "--speculative", "ngram:4", "--spec-policy", "always")
    assert run(core, [prompt]) == [greedy(m, prompt)]
    stats = core.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]


def test_what_v41_cannot_do_yet_is_refused_by_flag(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match="DSpark layers, which kvmesh does not serve yet"):
        engine(directory, "--speculative", "mtp:2")      # V4.1 ships DSpark drafts, not MTP


def test_truncation_keeps_at_least_the_window_and_the_backtrack(saved):
    directory, _ = saved             # W = 128, B = 6: a cut inside the window is refused
    with pytest.raises(ValueError, match="KEEP = 133 is smaller than W \\+ B = 134"):
        engine(directory, "--truncation", "compact", "--keep-tokens", "133")
    assert engine(directory, "--truncation", "mask", "--keep-tokens", "134").path.keep == 134


def test_the_equivalence_script_runs_on_a_v41_checkpoint(saved, tmp_path, capsys):
    """bench/quality/truncation.py --model: mask == compact to noise, off measurably apart."""
    import json

    from bench.quality import truncation
    directory, _ = saved
    out = tmp_path / "r.json"
    assert truncation.main(["--model", str(directory), "--length", "300", "--decode", "4",
                            "--dtype", "float64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["pair"]: r for r in res["rows"]}
    assert rows["logits mask-compact"]["max"] < 1e-9
    assert rows["logits off-compact"]["max"] > 1e-6
    assert res["agree"]["mask-compact"] == 4
    assert "per-position L2 distance" in capsys.readouterr().out
