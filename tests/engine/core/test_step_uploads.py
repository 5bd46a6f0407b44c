"""Every index tensor a forward builds from host ints goes up before its first layer, through
the step's one upload helper (device.Uploads; docs: docs/deployment/devices.md).

On CUDA a copy from pageable host memory waits for the stream to drain, so an index tensor
made from host ints after the first layer was queued would stall the step behind its own
layers (the window plan's slot rows and the logit rows used to be built that way). This
machine has no GPU, so the uploads are counted instead of timed. The helper makes its tensors
from int64 arrays (no aten op), and a torch dispatch mode sees every other tensor made from a
host list (`torch.tensor` of a list is the aten op lift_fresh). The test checks, in a plain
decode step and in a step that mixes decode rows with prefill chunks (window pool and gather
paths, a mirror refill, compressor feeding), that the helper made them all, none of them
after the first layer started, and that no tensor was made from a host list past it.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine import device as device_mod
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt

CFG = small_test_config()


class Uploads(TorchDispatchMode):
    """Tensors made from host data inside a forward, before and after its first layer."""

    def __init__(self):
        super().__init__()
        self.phase = None            # None: outside the forward; "early" / "late"
        self.seen = {"early": 0, "late": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default and self.phase:
            self.seen[self.phase] += 1
        return func(*args, **(kwargs or {}))


def count_uploads(monkeypatch, engine):
    """Runs one engine step; returns (lift_fresh before / after the first layer, the
    helper's lists before / after it)."""
    mode, helper = Uploads(), {"early": 0, "late": 0}
    runner = engine.runner
    forward, layer = runner.forward, runner._layer

    def in_forward(works):
        mode.phase = "early"
        try:
            return forward(works)
        finally:
            mode.phase = None

    def first_layer_starts(*a, **k):
        mode.phase = "late"
        return layer(*a, **k)

    many = device_mod.Uploads.many

    def counted(self, *lists):
        helper["late" if self.sealed else "early"] += len(lists)
        return many(self, *lists)

    monkeypatch.setattr(runner, "forward", in_forward)
    monkeypatch.setattr(runner, "_layer", first_layer_starts)
    monkeypatch.setattr(device_mod.Uploads, "many", counted)
    with mode:
        engine.step()
    monkeypatch.undo()
    return mode.seen, helper


def start(n: int, **kw):
    engine = make_engine(CFG, dtype="float32", num_slots=n + 1, max_running=n + 1,
                         num_blocks=64 * (n + 1), **kw)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(30 + 9 * i, i), params) for i in range(n)]
    while any(s.prefilling or s.slot is None for s in seqs):
        engine.step()
    return engine, seqs, params


def test_decode_step_uploads_everything_before_its_first_layer(monkeypatch):
    engine, seqs, _ = start(6)
    engine.step()
    before = [len(s.output) for s in seqs]
    seen, helper = count_uploads(monkeypatch, engine)
    assert [len(s.output) for s in seqs] == [b + 1 for b in before]
    assert helper["late"] == 0 and helper["early"] > 0, (seen, helper)
    assert seen == {"early": 0, "late": 0}, (seen, helper)        # none past the helper


@pytest.mark.parametrize("chunk", [12, 40])        # gather path / shared pool path
def test_mixed_prefill_and_decode_step_uploads_everything_before_its_first_layer(
        monkeypatch, chunk):
    engine, seqs, params = start(2, max_batched_tokens=chunk + 2)
    new = engine.add_request(random_prompt(120, 9), params)
    engine.step()                                   # admitted: its first chunk
    before = [len(s.output) for s in seqs]
    computed = new.num_computed
    seen, helper = count_uploads(monkeypatch, engine)
    assert [len(s.output) for s in seqs] == [b + 1 for b in before]     # decode rows ...
    assert new.num_computed - computed == chunk                          # ... beside a chunk
    assert helper["late"] == 0 and helper["early"] > 0, (seen, helper)
    assert seen == {"early": 0, "late": 0}, (seen, helper)
