"""A decode step reads the device only for the sampled ids (docs: services/engine/README.md,
"Device"): the number of host reads per step is a constant, the same for 1 or 6 sequences
and for 8 or 12 layers. On a GPU each such read is a sync that stalls the step's queue, so
a count that grew with the batch or the depth would be a per-token stall.

A host read is anything that turns device data into Python numbers: a scalar read
(`.item()`, `int()`, `float()`, `bool()` of a tensor: all the aten op _local_scalar_dense,
seen here by a dispatch mode) or `.tolist()` / `.numpy()` / `.cpu()` (patched). On the CPU
these cost nothing, which is why they must be counted rather than timed.

Also here: sampling draws on the logits' device with the same seeds as before (the batched
draw of a step equals one draw per row; speculative verification equals the host-side
reference it replaced, token for token).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine.config import small_test_config
from services.engine.core import speculative
from services.engine.core.sampling import SamplingParams, generator, sample_ids, target_probs
from tests.engine.helpers import make_engine, random_prompt

DEEP = ("swa", "swa") + ("csa", "hca") * 5


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def reads_in_one_decode_step(monkeypatch, batch: int, layers, temperature: float) -> int:
    cfg = small_test_config(layers=layers) if layers else small_test_config()
    engine = make_engine(cfg, dtype="float32", num_slots=batch, max_running=batch,
                         num_blocks=32 * batch)
    seqs = [engine.add_request(random_prompt(40 + 7 * i, i), SamplingParams(
        temperature=temperature, seed=i, max_tokens=20, ignore_eos=True)) for i in range(batch)]
    while any(s.prefilling or s.slot is None for s in seqs):
        engine.step()
    engine.step()                              # a plain decode step of every sequence
    bulk = []
    for name in ("tolist", "numpy", "cpu"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, **k: bulk.append(1) or _o(self, *a, **k))
    mode = HostReads()
    before = [len(s.output) for s in seqs]
    with mode:
        engine.step()
    monkeypatch.undo()
    assert [len(s.output) for s in seqs] == [b + 1 for b in before]     # it was a decode step
    return mode.count + len(bulk)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_host_reads_per_decode_step_do_not_grow_with_batch_or_depth(monkeypatch, temperature):
    counts = {(b, len(layers or small_test_config().layers)):
              reads_in_one_decode_step(monkeypatch, b, layers, temperature)
              for b, layers in ((1, None), (6, None), (6, DEEP))}
    assert set(counts.values()) == {1}, counts          # one read: the sampled ids


def test_batched_draw_equals_one_draw_per_row():
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(12):
        params = SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 5][i % 2],
                                top_p=[1.0, 0.8][i % 4 // 2], seed=None if i % 5 else 77)
        rows.append((torch.randn(50, generator=g), params, i, 1000 + i))
    want = []
    for logits, params, step, seed in rows:          # the per-row draw sampling always did
        if params.greedy:
            want.append(int(torch.argmax(logits)))
        else:
            gen = generator(params, step, seed)
            want.append(int(torch.multinomial(target_probs(logits, params), 1, generator=gen)))
    assert sample_ids(rows) == want


def verify_on_host(logits, drafts, params, step, seed, q=None):
    """speculative.verify as it was before its draws moved to the logits' device: CPU
    generators and the acceptance test in Python floats."""
    k = len(drafts)
    qs = speculative.draft_probs(drafts, q, logits.shape[-1], params)
    out = []
    for j, d in enumerate(drafts):
        p = target_probs(logits[j], params)
        u = float(torch.rand((), generator=generator(params, step + j, seed, 1),
                             dtype=torch.float64))
        if qs[j][d] > 0 and u * float(qs[j][d]) < float(p[d]):
            out.append(d)
            continue
        r = torch.clamp(p - qs[j], min=0)
        r = r / r.sum() if r.sum() > 0 else p
        return out + [int(torch.multinomial(r, 1, generator=generator(params, step + j, seed, 2)))]
    p = target_probs(logits[k], params)
    return out + [int(torch.multinomial(p, 1, generator=generator(params, step + k, seed)))]


def test_seeded_verification_gives_the_same_tokens_as_before():
    g = torch.Generator().manual_seed(5)
    cases = accepted = 0
    for i in range(60):
        params = SamplingParams(temperature=0.9, top_k=[0, 8][i % 2], seed=i)
        logits = torch.randn(4, 16, generator=g) * 2                # fp32, as the engine's
        q = torch.randn(3, 16, generator=g) * 2 if i % 3 else None  # sampled / n-gram drafter
        drafts = torch.randint(0, 16, (3,), generator=g).tolist()
        if i % 4 == 0:                                              # drafts the target likes
            drafts = torch.argmax(logits[:3], dim=-1).tolist()
        got = speculative.verify(logits, drafts, params, i, 99, q)
        assert got == verify_on_host(logits, drafts, params, i, 99, q)
        cases += 1
        accepted += len(got) - 1
    assert cases == 60 and accepted > 10          # both acceptances and rejections happened
