"""Prefill chunk rows' fast paths compute what the plain ones do: the window pool of a chunk
that continues in the window mirror is taken from it as it is (no dequantize, no hit test),
long chunks' pools split into row blocks, compressor feeding without a stream copy."""

import pytest
import torch

from kernels.ring_rows import dequantize_rows
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model.window_mirror import WindowMirror
from tests.engine.core.test_equivalence import EXACT, max_logit_error
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()


def counting(monkeypatch, owner, name: str) -> dict:
    """Patches owner.name (for this test) to count its calls; returns the counter {"n": ...}."""
    calls, f = {"n": 0}, getattr(owner, name)

    def counted(*a, **k):
        calls["n"] += 1
        return f(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_continuing_chunks_take_the_mirror_as_it_holds_every_row(monkeypatch):
    """Every row a continuing chunk takes from the mirror is held there at its position and
    equals the ring bytes dequantized. A new prompt's first chunk sees no older row, so it
    takes the mirror too (what it names there is masked); the first chunk after a snapshot
    restore sees restored rows and goes through read, which dequantizes them."""
    engine = make_engine(CFG, num_slots=4, max_batched_tokens=64, long_prefill_chunk=24)
    calls = {"take": 0, "rows": 0}
    take = WindowMirror.take

    def checked_take(self, layer, slots, pos):
        calls["take"] += 1
        live = pos >= 0                      # negative positions: before the prompt, masked
        ri = pos.remainder(self.swa[layer].shape[1])
        assert torch.equal(self.pos[layer][slots, ri][live], pos[live])
        want = dequantize_rows(self.swa[layer][slots, ri], self.dtype)
        got = take(self, layer, slots, pos)
        assert torch.equal(got[live], want[live])
        calls["rows"] += int(live.sum())
        return got

    monkeypatch.setattr(WindowMirror, "take", checked_take)
    reads = counting(monkeypatch, WindowMirror, "read")
    seqs = [engine.add_request(random_prompt(n, n), SamplingParams(temperature=0, max_tokens=5))
            for n in (150, 90, 20)]
    run_to_completion(engine)
    assert calls["take"] and calls["rows"] and reads["n"] == 0, (calls, reads)
    for seq in seqs:
        assert max_logit_error(engine, CFG, seq) <= EXACT

    # a prompt sharing the stored prefix of an earlier one ((150 - 1) // 16 * 16 tokens) is
    # admitted at 144 with its slot's window restored from the snapshot (reuse needs YOCO
    # truncation); its logits are a cold run's. (Truncated decoder chunks name older rows
    # below their bound, masked and not held, so the plain take from here on.)
    monkeypatch.setattr(WindowMirror, "take", take)
    base, greedy = random_prompt(150, 150), SamplingParams(temperature=0, max_tokens=5)
    second = base[:144] + random_prompt(40, 7)
    runs = {}
    for name in ("warm", "cold"):
        e = make_engine(CFG, num_slots=4, max_batched_tokens=64, long_prefill_chunk=24,
                        truncation="compact", keep_tokens=22)
        if name == "warm":
            e.add_request(base, greedy)
            run_to_completion(e)
        reads["n"] = 0
        seq = e.add_request(second, greedy)
        run_to_completion(e)
        runs[name] = (e, seq, reads["n"])
    (warm, hit, hit_reads), (cold, twin, cold_reads) = runs["warm"], runs["cold"]
    assert hit.cached_tokens == 144 and hit_reads, (hit.cached_tokens, hit_reads)
    assert twin.cached_tokens == 0 and cold_reads == 0, (twin.cached_tokens, cold_reads)
    assert hit.output == twin.output
    got, want = torch.stack(warm.logits[hit.request_id]), torch.stack(cold.logits[twin.request_id])
    assert float((got - want).abs().max()) <= 1e-9


def test_a_replay_reads_no_masked_window_rows(monkeypatch):
    """A bounded replay starts at its window's lower bound (L1 - W for the encoder, L - KEEP
    for the truncated decoder), so its first chunk sees no older row: it reads none from the
    ring (the replay's numbers are pinned in test_bounded_replay.py)."""
    reads = counting(monkeypatch, WindowMirror, "read")
    first = random_prompt(150, 11)
    second = first[:112] + random_prompt(40, 12)       # cap 152 - 22 = 130 -> L1 = 112
    engine = make_engine(CFG, truncation="compact", keep_tokens=22, swa_policy="zero",
                         max_batched_tokens=64)
    engine.add_request(first, SamplingParams(temperature=0, max_tokens=1))
    run_to_completion(engine)
    reads["n"] = 0
    seq = engine.add_request(second, SamplingParams(temperature=0, max_tokens=6))
    run_to_completion(engine)
    assert (seq.cached_tokens, seq.replayed_tokens) == (112, 16)
    assert reads["n"] == 0, reads


def test_group_aligned_chunks_feed_the_compressor_without_a_gather(monkeypatch):
    """Chunks ending on group boundaries with no stored tail pool their own rows in place
    (FeedPlan.pick None); unaligned ones and decodes gather; both exact."""
    from services.engine.model import compressor

    engine = make_engine(CFG, num_slots=4, max_batched_tokens=256, long_prefill_chunk=32)
    kinds = []
    stream, pool = compressor._stream, compressor.cpu_pool.pool_into
    monkeypatch.setattr(compressor, "_stream",
                        lambda plan, *a: kinds.append(plan.pick is None) or stream(plan, *a))

    def pool_into(table, rows, v, z, ring, tail_at, pick, *rest):    # the C group path
        done = pool(table, rows, v, z, ring, tail_at, pick, *rest)
        if done:
            kinds.append(pick is None)
        return done
    monkeypatch.setattr(compressor.cpu_pool, "pool_into", pool_into)
    seqs = [engine.add_request(random_prompt(n, n), SamplingParams(temperature=0, max_tokens=6))
            for n in (96, 77)]
    run_to_completion(engine)
    assert True in kinds and False in kinds, kinds
    for seq in seqs:
        assert max_logit_error(engine, CFG, seq) <= EXACT


def test_pool_blocks_cover_every_key_a_row_may_see():
    """A long chunk's pool plan, block by block, against the window rule written out: row j
    (position p = first + j) sees key k of cat(W - 1 older rows, chunk rows) (position
    first - W + 1 + k) iff max(lo, p - W + 1) <= position <= p; no block leaves out a key
    one of its rows may see, and blocks tile the chunk's rows."""
    from services.engine.model import windows
    from services.engine.model.batch import StepBatch
    from services.engine.model.runner import Work

    w = CFG.window
    for first, n, lo in ((0, 200, 0), (37, 129, 30), (300, 64, 0), (5, 65, 0)):
        work = Work(0, [1] * 40, [0] * (first + n), first, first + n, enc_lo=lo)
        step = StepBatch.build([work], compact=True)
        plan = windows.plan(step, step.enc, w + 6, w, True, frozenset())
        (pool,) = plan.pools
        k = torch.arange(w - 1 + n) + first - w + 1
        p = (torch.arange(n) + first).unsqueeze(1)
        rule = (k <= p) & (k >= torch.clamp(p - w + 1, min=lo))              # [n, W - 1 + n]
        covered = 0
        for b in pool.blocks:
            assert b.rows.start == covered and b.rows.stop - b.rows.start <= windows.POOL_BLOCK
            covered = b.rows.stop
            assert torch.equal(b.ok, rule[b.rows, b.keys])
            assert int(rule[b.rows].sum()) == int(b.ok.sum())               # nothing outside
        assert covered == n


@pytest.mark.parametrize("on_cpu", [False, True], ids=["pool", "gather"])
def test_short_chunks_take_a_pool_on_the_cpu_and_both_paths_are_exact(monkeypatch, on_cpu):
    """Chunks of 8-16 rows beside decodes: their own pool on the CPU (GATHER_ON_CPU off), the
    per-row gathered keys when pinned; exact against the reference either way."""
    from services.engine.model import windows

    monkeypatch.setattr(windows, "GATHER_ON_CPU", on_cpu)
    paths = []
    plan = windows.plan

    def record(step, seg, *a):
        out = plan(step, seg, *a)
        paths.append((out.gather is not None, len(out.pools)))
        return out

    monkeypatch.setattr(windows, "plan", record)
    engine = make_engine(CFG, num_slots=4, max_batched_tokens=64, long_prefill_chunk=12)
    decoder = engine.add_request(random_prompt(30, 1), SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    seq = engine.add_request(random_prompt(70, 2), SamplingParams(temperature=0, max_tokens=4))
    run_to_completion(engine)
    assert any(g for g, _ in paths) == on_cpu          # the 12-row chunks gathered only if pinned
    assert on_cpu or any(p for _, p in paths)           # else they took pools
    for s in (decoder, seq):
        assert max_logit_error(engine, CFG, s) <= EXACT


def test_staged_chunk_keys_give_the_bits_of_the_copied_pool(monkeypatch):
    """fp32 on the CPU: a chunk that continues in its mirror has its window keys read by
    index, its older ones where they are in the mirror and its own from the mirror's scratch
    rows, with no copy taken; the logits are those of the pool copied per layer, bit for bit
    (the same keys in the same order; the copied path's own error is pinned elsewhere)."""
    from kernels import cpu_ring

    if not cpu_ring.available(torch.zeros(1, CFG.head_dim)):
        pytest.skip("no compiled CPU library")
    takes = counting(monkeypatch, WindowMirror, "take")

    def run(scratch: bool):
        engine = make_engine(CFG, dtype="float32", num_slots=4, max_batched_tokens=64,
                             long_prefill_chunk=24)
        assert engine.runner.mirror.scratch_rows > 0
        if not scratch:
            engine.runner.mirror.scratch_rows = 0          # every pool copied per layer
        takes["n"] = 0
        seqs = [engine.add_request(random_prompt(n, n), SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True)) for n in (20, 150, 90)]
        run_to_completion(engine)
        return engine, seqs, takes["n"]

    staged, seqs, staged_takes = run(True)
    copied, twins, copied_takes = run(False)
    assert staged_takes == 0 < copied_takes, (staged_takes, copied_takes)
    for seq, twin in zip(seqs, twins, strict=True):
        a, b = staged.logits[seq.request_id], copied.logits[twin.request_id]
        assert len(a) == len(b) == 6
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), len(seq.prompt)
