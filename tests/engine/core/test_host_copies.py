"""The engine's delivery of device-to-host copies (device.HostCopies): on CUDA a completed
block's bytes (kvstore write-through) and a snapshot's bytes (host store) land a step or
more after the forward that made them, and the engine hands them on when they have landed,
all of them once it is idle. This machine has no GPU, so the copies here are made to land
one poll late, as a CUDA copy still in flight would (the CUDA class itself is tested in
tests/engine/core/test_device.py, gpu-marked); everything else is the real engine. The blocks and
snapshots delivered must be byte-identical to those of the engine whose copies land at once,
and some of them must really have waited. The prefill/decode handoff export goes the same
way (its HANDOFF event waits for its bytes)."""

import torch

from services.engine import device as device_mod
from services.engine.config import TINY, small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.core.sequence import Finish
from services.engine.model import weights as weights_mod
from tests.engine.helpers import Recorder, make_engine, random_prompt, run_to_completion

CFG = small_test_config()
TINY_W = weights_mod.init_weights(TINY, 0, torch.float64)


class LateCopies(device_mod.HostCopies):
    """A copy is in flight for one poll and has landed by the next (poll(wait) takes all)."""

    def submit(self, data, done) -> None:
        self._pending.append([data.clone(), done, False])

    def poll(self, wait: bool = False) -> int:
        n = 0
        while self._pending and (wait or self._pending[0][2]):
            data, done, _ = self._pending.popleft()
            done(data.contiguous().numpy().tobytes())
            n += 1
        for item in self._pending:
            item[2] = True
        return n


def run(late: bool, monkeypatch):
    if late:
        monkeypatch.setattr(device_mod, "HostCopies", LateCopies)
    engine = make_engine(CFG, truncation="compact", keep_tokens=22, num_slots=4,
                         max_batched_tokens=64)
    monkeypatch.undo()
    engine.hooks = Recorder()
    waited = 0
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(40 + 23 * i, i), params) for i in range(4)]
    while engine.has_work:
        engine.step()
        waited = max(waited, engine.copies.pending + engine.prefix.copies.pending)
    return engine, [s.output for s in seqs], waited


def test_late_copies_deliver_the_same_blocks_and_snapshots(monkeypatch):
    now, out_now, waited_now = run(False, monkeypatch)
    late, out_late, waited_late = run(True, monkeypatch)
    assert isinstance(late.copies, LateCopies) and waited_now == 0 and waited_late > 0
    assert out_late == out_now
    assert late.copies.pending == late.prefix.copies.pending == 0      # idle: all delivered
    assert len(now.hooks.blocks) > 10 and late.hooks.blocks == now.hooks.blocks
    assert len(now.hooks.published) > 2 and late.hooks.published == now.hooks.published
    assert len(late.prefix.store) == len(now.prefix.store) > 0
    assert all(late.prefix.store.get(k).data == data for k, data in now.hooks.published.items()
               if k in now.prefix.store)
    # and a request after them still finds the blocks and snapshots (a cache hit)
    for engine in (now, late):
        seq = engine.add_request(random_prompt(40 + 23 * 3, 3) + [5, 6], SamplingParams(
            temperature=0, max_tokens=2))
        run_to_completion(engine)
        assert seq.cached_tokens > 0


def handoffs(late: bool, monkeypatch):
    """A prefill engine's handoffs of a few requests (each event with the step it came in)."""
    if late:
        monkeypatch.setattr(device_mod, "HostCopies", LateCopies)
    pe = make_engine(TINY, weights=TINY_W, extra_state=True, truncation="compact",
                     keep_tokens=134, num_blocks=64, num_slots=4, max_batched_tokens=256)
    monkeypatch.undo()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5)
    for i, n in enumerate((140, 200, 263)):
        pe.add_request(random_prompt(n, 50 + i), params, request_id=f"r{i}", handoff=True)
    got, steps, held = {}, 0, 0
    while pe.has_work:
        steps += 1
        for ev in pe.step():
            if ev.finish is Finish.HANDOFF:
                assert ev.handoff is not None and ev.request_id not in got
                got[ev.request_id] = (ev.handoff, steps)
        held = max(held, pe.exports.pending)
    assert pe.copies.pending == pe.exports.pending == 0             # idle: all delivered
    return pe, got, held


def test_late_handoff_exports_give_the_same_handoffs(monkeypatch):
    """The prefill/decode handoff export goes through HostCopies like blocks and snapshots:
    with copies that land late the HANDOFF events come later, with byte-identical handoffs,
    and a decode engine adopts them."""
    now, want, held_now = handoffs(False, monkeypatch)
    late, got, held_late = handoffs(True, monkeypatch)
    assert held_now == 0 and held_late > 0 and set(got) == set(want) == {"r0", "r1", "r2"}
    assert any(got[r][1] > want[r][1] for r in want)                # some came a step later
    for rid, (h, _) in want.items():
        g = got[rid][0]
        assert (g.slot.state, g.slot.blocks, g.slot.hashes, g.output) == \
            (h.slot.state, h.slot.blocks, h.slot.hashes, h.output)
        assert late.handoffs.get(rid) is g
    assert late.stats()["handoffs_out"] == now.stats()["handoffs_out"] == 3
    ce = make_engine(TINY, weights=TINY_W, truncation="compact", keep_tokens=134,
                     num_blocks=64, num_slots=4)
    seqs = [ce.adopt(got[r][0]) for r in sorted(got)]
    run_to_completion(ce)
    assert all(len(s.output) == 5 for s in seqs)
