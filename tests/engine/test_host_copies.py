"""The engine's delivery of device-to-host copies (device.HostCopies): on CUDA a completed
block's bytes (kvstore write-through) and a snapshot's bytes (host store) land a step or
more after the forward that made them, and the engine hands them on when they have landed,
all of them once it is idle. This machine has no GPU, so the copies here are made to land
one poll late, as a CUDA copy still in flight would (the CUDA class itself is tested in
tests/engine/test_device.py, gpu-marked); everything else is the real engine. The blocks and
snapshots delivered must be byte-identical to those of the engine whose copies land at once,
and some of them must really have waited."""

from services.engine import device as device_mod
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import Recorder, make_engine, random_prompt, run_to_completion

CFG = small_test_config()


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
