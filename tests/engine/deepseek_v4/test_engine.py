"""The engine serving a DeepSeek V4 checkpoint (Engine, built by `--model DIR`) against
transformers' greedy generation on the checkpoint transformers saved, in float64: one
sequence, every prefill chunk size, batched decodes beside a prefill chunk, a prefix hit
through shared blocks + snapshot, and the bounded replay of a hit without one."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4 import ledgers
from tests.engine.deepseek_v4 import tiny
from tests.engine.deepseek_v4.replay_reference import truncated_window_logits
from tests.engine.engines import serve_core

pytest.importorskip("transformers")
TOKENS = 64


def word_tokenizer(directory) -> None:
    """A tokenizer.json naming ids 0..99 w0..w99 (the tiny configs' vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(tiny.BASE["vocab_size"])},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def checkpoint(name: str, directory):
    """Save config `name` with transformers and its tokenizer; the float64 model."""
    hf = tiny.save(name, directory).double()
    word_tokenizer(directory)
    return hf


def engine(directory, *flags: str) -> Engine:
    """An Engine built from these flags, float64 unless they say otherwise."""
    return serve_core("--model", str(directory), "--dtype", "float64", *flags)


def hf_greedy(hf, prompt: list[int], n: int = TOKENS) -> list[int]:
    """transformers' greedy continuation through its forward and DynamicCache (equal to its
    one-pass forward within 1e-6: test_cached.py). Not `generate`: on flash_geometry its
    logits differ from the model's own forward by ~6e-2 from the first token on."""
    from transformers import DynamicCache
    cache, out, ids = DynamicCache(config=hf.config), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = hf(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def run(core: Engine, prompts: list[list[int]], n: int = TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in prompts]
    while core.has_work:
        core.step()
    core.check_integrity()
    return [r.output for r in reqs]


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.BASE["vocab_size"], (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["flash_geometry", "mixed", "topk_nested_yarn"])
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, checkpoint(request.param, directory)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    directory = tmp_path_factory.mktemp("flash")
    return directory, checkpoint("flash_geometry", directory)


def test_greedy_equals_transformers(saved):
    name, directory, hf = saved
    prompt = tiny.prompt(name).tolist()
    assert run(engine(directory), [prompt]) == [hf_greedy(hf, prompt)]


@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_every_prefill_chunk_size_gives_the_same_tokens(flash, chunk):
    directory, hf = flash
    prompt = tiny.prompt("flash_geometry").tolist()
    core = engine(directory, "--long-prefill-chunk", str(chunk), "--swa-policy", "zero")
    assert run(core, [prompt], 16) == [hf_greedy(hf, prompt, 16)]


def test_eight_decodes_beside_a_prefill_chunk(flash, monkeypatch):
    directory, hf = flash
    core = engine(directory, "--long-prefill-chunk", "64")
    steps = []
    real = ledgers.step

    def counting(model, led, works, **kw):
        steps.append(sorted(len(ids) for _, ids in works))
        return real(model, led, works, **kw)
    monkeypatch.setattr(ledgers, "step", counting)
    short = [random_prompt(20 + 3 * i, seed=10 + i) for i in range(8)]
    long = random_prompt(200, seed=99)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in short]
    core.step()                                     # the eight prefill together
    late = core.add_request(long, params)
    while core.has_work:
        core.step()
    core.check_integrity()
    assert any(s.count(1) == 8 and 64 in s for s in steps), steps   # decodes + a chunk
    for req, prompt in zip(reqs + [late], short + [long], strict=True):
        assert req.output == hf_greedy(hf, prompt, 12)


def test_prefix_hit_through_blocks_and_snapshot_equals_cold(flash):
    directory, hf = flash
    core = engine(directory)
    first = random_prompt(300, seed=3)
    second = first[:256] + random_prompt(40, seed=4)
    run(core, [first], 4)
    assert core.stats()["snapshot_stores"] == 1          # at 256: (300 - 1) // 128 * 128
    out = run(core, [second])
    stats = core.stats()
    assert (stats["snapshot_hits"], stats["cache_hit_tokens"], stats["block_hits_local"]) \
        == (1, 256, 2)
    assert out == [hf_greedy(hf, second)]
    # the second prompt computed only its own 40 tokens and its decodes
    assert stats["computed_tokens"] == (300 + 3) + (40 + TOKENS - 1)


def test_a_hit_without_snapshot_runs_the_bounded_replay(flash):
    directory, _ = flash
    core = engine(directory, "--swa-policy", "zero")
    first = random_prompt(300, seed=5)
    second = first[:256] + random_prompt(30, seed=6)
    run(core, [first], 2)
    out = run(core, [second], 1)
    stats = core.stats()
    assert (stats["snapshot_misses"], stats["replayed_tokens"], stats["cache_hit_tokens"]) \
        == (1, 128, 256)
    reference = truncated_window_logits(core.model, second, 256)[-1]
    assert out == [[int(reference.argmax())]]


def test_isolated_replay_blocks_are_not_shared(flash):
    directory, _ = flash
    core = engine(directory, "--swa-policy", "zero", "--replay-blocks", "isolate")
    first = random_prompt(300, seed=7)
    run(core, [first], 2)
    second = first[:256] + random_prompt(200, seed=8)       # its replay completes block 2
    run(core, [second], 1)
    third = second[:384] + [1, 2, 3]
    run(core, [third], 1)
    assert core.stats()["cache_hit_tokens"] == 256 + 256    # not 256 + 384


def test_truncation_is_refused_by_name(flash):
    directory, _ = flash
    with pytest.raises(ValueError, match="--truncation"):
        engine(directory, "--truncation", "mask", "--keep-tokens", "200")


def test_mxfp8_rings_equal_the_full_forward_with_their_rounding(flash):
    """The serving layout (528 B MXFP8 ring rows, what float32 engines keep) on a float64
    model: greedy tokens of the full forward that rounds window rows the same way."""
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.model.deepseek_v4.forward import V4Model

    directory, _ = flash
    exact = engine(directory)
    model = V4Model(exact.model.cfg, exact.model.weights, torch.float64, stored=True,
                    rows="mxfp8")
    core = Engine(model, EngineConfig(dtype="float64"), exact.tokenizer, "flash")
    assert core.ledgers.slot_layout.row_bytes == 528
    prompt = tiny.prompt("flash_geometry").tolist()
    tokens = list(prompt)
    for _ in range(16):
        tokens.append(int(model.logits(torch.tensor(tokens))[-1].argmax()))
    assert run(core, [prompt], 16) == [tokens[len(prompt):]]


def test_cli_generate_local_gives_transformers_continuation(saved):
    """`kvmesh generate --local --model DIR --dtype float64 --temperature 0`: the text of
    transformers' greedy tokens (up to the config's end token, which ends it)."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    name, directory, hf = saved
    prompt = tiny.prompt(name).tolist()[:60]
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    expected = hf_greedy(hf, prompt, 24)
    eos = hf.config.eos_token_id
    if eos in expected:
        expected = expected[:expected.index(eos)]
    run_ = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "generate", "--local", "--model",
                           str(directory), "--dtype", "float64", "--temperature", "0",
                           "--max-tokens", "24", tok.decode(prompt)],
                          capture_output=True, text=True, timeout=300)
    assert run_.returncode == 0, run_.stderr
    assert run_.stdout.strip() == tok.decode(expected)
    stopped = len(expected) < 24                 # the end token counts as generated
    usage = f"[{'stop' if stopped else 'length'}: {len(prompt)} prompt tokens, " \
            f"{len(expected) + stopped} generated]"
    assert usage in run_.stderr


def test_layout_prints_what_the_engine_allocates(flash):
    import json
    import subprocess
    import sys

    directory, _ = flash
    for dtype in ("float32", "float64"):
        core = engine(directory, "--dtype", dtype, "--num-blocks", "8")
        out = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "engine", "layout", "--model",
                              str(directory), "--dtype", dtype, "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        rep = json.loads(out.stdout)
        led = core.ledgers
        assert rep["state_slot"]["bytes"] == led.data.shape[1]
        assert rep["state_slot"]["swa_row_bytes"] == led.slot_layout.row_bytes \
            == {"float32": 528, "float64": 4096}[dtype]
        assert rep["block"]["bytes"] == led.block_bytes()
        assert rep["state_slot"]["snapshot_bytes"] == core.prefix.snapshot_bytes


def test_fetched_blocks_and_snapshot_hit_and_a_damaged_block_is_refused(flash):
    """What rpc/remote.py prefetches (kvstore blocks, a peer's snapshot) starts a prompt on
    another engine exactly where a cold run is; a damaged block ends the run of fetched blocks
    before it (counted), and the request still runs."""
    from kvmesh.services.engine.cache.prefetch import Prefetched

    directory, hf = flash
    a = engine(directory)
    first = random_prompt(300, seed=41)
    run(a, [first], 2)
    second = first[:256] + random_prompt(40, seed=42)

    def prefetched(b, damage: bool) -> Prefetched:
        view = b.local_view(second, "")
        blocks = {h: a.ledgers.blocks.serialize(a.ledgers.pool.lookup(h)) for h in view.hashes}
        if damage:
            last = view.hashes[-1]
            blocks[last] = blocks[last][:-1] + bytes([blocks[last][-1] ^ 1])
        keys = {a.prefix.key(h): a.prefix.store.get(a.prefix.key(h)) for h in view.hashes}
        return Prefetched(view.hashes, blocks, {k: s for k, s in keys.items() if s})

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    b = engine(directory)
    req = b.add_request(second, params, prefetched=prefetched(b, damage=False))
    while b.has_work:
        b.step()
    stats = b.stats()
    assert (stats["block_hits_remote"], stats["snapshot_hits"], stats["computed_tokens"]) \
        == (2, 1, 40 + TOKENS - 1)
    assert req.output == hf_greedy(hf, second)
    c = engine(directory, "--swa-policy", "zero")
    req = c.add_request(second, params, prefetched=prefetched(c, damage=True))
    while c.has_work:
        c.step()
    stats = c.stats()
    assert (stats["remote_blocks_refused"], stats["block_hits_remote"],
            stats["snapshot_misses"]) == (1, 1, 1)          # one good block: a bounded replay
    assert len(req.output) == TOKENS


@pytest.mark.parametrize("k", [3, 6])
def test_ngram_speculation_with_rejected_drafts_gives_the_same_tokens(saved, k):
    """Drafts are verified and the rows of rejected ones taken back (up to 6): greedy output
    is transformers' token for token, and some drafts were rejected on the way."""
    name, directory, hf = saved
    core = engine(directory, "--speculative", f"ngram:{k}", "--spec-policy", "always")
    prompt = tiny.prompt(name).tolist()
    assert run(core, [prompt]) == [hf_greedy(hf, prompt)]
    stats = core.stats()
    assert stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"], stats
    if name != "topk_nested_yarn":          # its 64 tokens hardly repeat: every draft fails
        assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["computed_tokens"] > len(prompt) + TOKENS - 1     # rejected rows ran too


def test_prefill_engine_hands_off_to_a_decode_engine(flash):
    """A prefill engine (396-row rings) prefills and samples the first token; a decode engine
    (134 rows) adopts the handoff (its first block already held, so shared) and decodes:
    transformers' tokens. A damaged block is refused by name; a prefill engine's rings are
    refused as a decode engine's."""
    from dataclasses import replace

    from kvmesh.errors import InvalidArgument

    directory, hf = flash
    pe = engine(directory, "--role", "prefill")
    assert pe.ledgers.swa[0].shape[1] == 396
    prompt = tiny.prompt("flash_geometry").tolist()
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    pe.add_request(prompt, params, request_id="r1", handoff=True)
    events = []
    while pe.has_work:
        events += pe.step()
    (last,) = [e for e in events if e.finish is not None]
    h = last.handoff
    assert last.finish.value == "handoff" and pe.handoffs.get("r1") is h
    assert (len(h.slot.blocks), len(h.slot.hashes)) == (3, 2)      # 310 tokens: 2 full + 1
    ce = engine(directory, "--role", "decode")
    run(ce, [prompt[:128] + [5]], 1)                  # holds the first block
    damaged = list(h.slot.blocks)
    damaged[2] = damaged[2][:-1] + bytes([damaged[2][-1] ^ 1])
    with pytest.raises(InvalidArgument, match="handoff refused: .*digest"):
        ce.adopt(replace(h, slot=replace(h.slot, blocks=tuple(damaged))))
    with pytest.raises(InvalidArgument, match="rings are 396 rows"):
        engine(directory, "--role", "prefill").adopt(h)
    req = ce.adopt(h)
    while ce.has_work:
        ce.step()
    ce.check_integrity()
    assert req.output == hf_greedy(hf, prompt)
    assert ce.stats()["handoff_blocks_local"] == 1


@pytest.mark.parametrize("name", ["flash_geometry", "mixed"])
def test_every_sampled_row_equals_the_full_forward_and_transformers(name, tmp_path, monkeypatch):
    """The logits each generated token was drawn from (prefill in 64-token chunks, then
    decodes), against the one-pass forward over the final sequence: ours and transformers'."""
    from kvmesh.services.engine.core import engine as engine_module

    hf = checkpoint(name, tmp_path)
    core = engine(tmp_path, "--long-prefill-chunk", "64")
    rows: dict[int, torch.Tensor] = {}
    real = engine_module.draw_batch

    def capturing(batch):
        for logits, _, index, _ in batch:
            rows[index] = logits.clone()
        return real(batch)
    monkeypatch.setattr(engine_module, "draw_batch", capturing)
    prompt = tiny.prompt(name).tolist()
    (output,) = run(core, [prompt], 32)
    tokens = torch.tensor(prompt + output)
    at = torch.arange(len(prompt) - 1, len(tokens) - 1)
    ours = torch.stack([rows[i] for i in range(32)])
    with torch.no_grad():
        theirs = hf(tokens.view(1, -1), use_cache=False).logits[0][at]
    assert (ours - core.model.logits(tokens)[at]).abs().max().item() <= 1e-6
    assert (ours - theirs).abs().max().item() <= 1e-6
