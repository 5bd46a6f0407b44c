"""A decode step reads the device only for the sampled ids (docs: services/engine/README.md,
"Device"): the number of host reads per step is a constant, the same for 1 or 6 sequences
and for 8 or 12 layers. On a GPU each such read is a sync that stalls the step's queue, so
a count that grew with the batch or the depth would be a per-token stall.

A host read is anything that turns device data into Python numbers: a scalar read
(`.item()`, `int()`, `float()`, `bool()` of a tensor: all the aten op _local_scalar_dense,
seen here by a dispatch mode) or `.tolist()` / `.numpy()` / `.cpu()` (patched). On the CPU
these cost nothing, which is why they must be counted rather than timed.

Also here: sampling draws on the logits' device with the same seeds as before (the batched
draw of a step equals one draw per row; speculative verification equals a host-side
reference that draws one row at a time, token for token).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine import device as device_mod
from services.engine.config import small_test_config
from services.engine.core import speculative
from services.engine.core.sampling import (
    SamplingParams,
    draw_one,
    generator,
    sample_ids,
    target_probs,
)
from services.engine.model import weights as weights_mod
from tests.engine.helpers import Recorder, make_engine, random_prompt

DEEP = ("swa", "swa") + ("csa", "hca") * 5


aten = torch.ops.aten
# ops whose result size depends on the data: on CUDA each reads a count back to the host
SIZED_BY_DATA = {aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
                 aten.unique_consecutive.default, aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """Counts the host reads torch makes on the device's behalf: scalar reads, ops sized by
    their data (nonzero, unique, masked_select, a boolean index, repeat_interleave without
    output_size), whose CPU versions read nothing but whose CUDA versions sync."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []       # what was counted (a failing assert shows it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is aten._local_scalar_dense.default or func in SIZED_BY_DATA
                or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)
                or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
                    and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                            for i in args[1] if i is not None))):
            self.count += 1
            self.where.append(str(func))
        return func(*args, **kwargs)


def reads_in_one_decode_step(monkeypatch, batch: int, layers, temperature: float) -> int:
    cfg = small_test_config(layers=layers) if layers else small_test_config()
    engine = make_engine(cfg, dtype="float32", num_slots=batch, max_running=batch,
                         num_blocks=32 * batch)
    seqs = [engine.add_request(random_prompt(40 + 7 * i, i), SamplingParams(
        temperature=temperature, seed=i, max_tokens=20, ignore_eos=True)) for i in range(batch)]
    while any(s.prefilling or s.slot is None for s in seqs):
        engine.step()
    engine.step()                              # a plain decode step of every sequence
    before = [len(s.output) for s in seqs]
    reads = reads_in_one_step(monkeypatch, engine)
    assert [len(s.output) for s in seqs] == [b + 1 for b in before]     # it was a decode step
    return reads


def reads_in_one_step(monkeypatch, engine) -> int:
    """Host reads of the engine's next step. A device.HostCopies submit is not one: on a GPU
    it queues a copy to pinned memory and returns (test_host_copies.py), on the CPU it hands
    the bytes over at once, which is not counted here."""
    bulk, off = [], []
    def counted(orig):
        def read(self, *a, **k):
            if not off:
                bulk.append(1)
            return orig(self, *a, **k)
        return read

    for name in ("tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    submit = device_mod.HostCopies.submit

    def uncounted(self, data, done):
        off.append(1)
        try:
            submit(self, data, done)
        finally:
            off.pop()

    monkeypatch.setattr(device_mod.HostCopies, "submit", uncounted)
    mode = HostReads()
    with mode:
        engine.step()
    monkeypatch.undo()
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


def test_draw_one_equals_torch_multinomial():
    """sampling.draw_one (no validity read) draws torch.multinomial's numbers: fp32 and fp64,
    zero entries, vocabularies of several sizes."""
    for i in range(400):
        g = torch.Generator().manual_seed(i)
        p = torch.softmax(torch.randn([7, 50, 300][i % 3], generator=g, dtype=torch.float64) * 3, 0)
        if i % 2:
            p = torch.where(torch.rand(p.shape, generator=g) < 0.5, 0.0, p)
        p = p.float() if i % 5 == 0 else p
        want = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(i))
        assert draw_one(p, torch.Generator().manual_seed(i)).tolist() == want.tolist()


def verify_one_at_a_time(logits, drafts, params, step, seed):
    """Verification on the host, one row at a time: each row's token as plain decoding draws
    it (argmax, or torch.multinomial with the token's generator), kept while it is the draft."""
    out = []
    for j, row in enumerate(logits):
        if params.greedy:
            tok = int(torch.argmax(row))
        else:
            tok = int(torch.multinomial(target_probs(row, params), 1,
                                        generator=generator(params, step + j, seed)))
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_judging_all_drafts_at_once_gives_the_tokens_of_one_at_a_time(temperature):
    g = torch.Generator().manual_seed(11)
    lengths = []
    for i in range(80):
        k = i % 5                                                   # 0 .. 4 drafts
        params = SamplingParams(temperature=temperature, top_k=[0, 8][i % 2],
                                top_p=[1.0, 0.9][i % 4 // 2], seed=i)
        logits = torch.randn(k + 1, 16, generator=g) * 2
        drafts = torch.randint(0, 16, (k,), generator=g).tolist()
        if i % 4 == 0:                                              # drafts the target likes
            drafts = [verify_one_at_a_time(logits[j:j + 1], [], params, i + j, 99)[0]
                      for j in range(k)]
        want = verify_one_at_a_time(logits, drafts, params, i, 99)
        assert speculative.verify(logits, drafts, params, i, 99) == want
        lengths.append(len(want) - 1)
    assert 0 in lengths and max(lengths) == 4          # rejections and whole acceptances


def spec_engine(method: str, batch: int, k: int, temperature: float, weights=None):
    cfg = small_test_config()
    engine = make_engine(cfg, dtype="float32", weights=weights, num_slots=batch,
                         max_running=batch, num_blocks=32 * batch, speculative=f"{method}:{k}")
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=30, ignore_eos=True)
    # periodic prompts: the n-gram drafter always finds a continuation
    seqs = [engine.add_request([5 + i, 9, 7, 1] * 12, params) for i in range(batch)]
    return engine, seqs


MTP_W = None


def mtp_weights():
    global MTP_W
    if MTP_W is None:
        MTP_W = weights_mod.init_weights(small_test_config(), seed=5, dtype=torch.float32, mtp=True)
    return MTP_W


def run_spec(method: str, temperature: float, judge=None, monkeypatch=None):
    if judge is not None:
        monkeypatch.setattr(speculative, "judge", judge)
    engine, seqs = spec_engine(method, 3, 3, temperature,
                               mtp_weights() if method == "mtp" else None)
    while engine.has_work:
        engine.step()
    if monkeypatch is not None:
        monkeypatch.undo()
    assert engine.stats()["spec_verify_steps"] > 0
    return [s.output for s in seqs], engine.stats()["spec_accepted_tokens"]


# sampled: a temperature at which some drafts of these random weights are accepted (the
# random MTP module's argmax drafts are accepted only greedily, and rarely)
@pytest.mark.parametrize("method, temperature", [("ngram", 0.0), ("ngram", 0.3), ("mtp", 0.0)])
def test_seeded_speculative_requests_give_the_tokens_of_one_at_a_time_verification(
        monkeypatch, method, temperature):
    """The engine with verdicts judged on the device and read once per step gives exactly
    the tokens of the engine verifying one draft at a time (the code it replaced)."""
    def reference(logits, drafts, params, step, seed):
        tokens = verify_one_at_a_time(logits, drafts, params, step, seed)
        return torch.tensor([len(tokens) - 1, tokens[-1]])

    want, accepted = run_spec(method, temperature, reference, monkeypatch)
    assert run_spec(method, temperature) == (want, accepted)
    assert accepted > 0


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_host_reads_per_speculative_step_do_not_grow_with_k_or_batch(monkeypatch, method):
    """A verify step reads the device once (sampled ids and every verdict together), and an
    mtp step once more for its drafts: a constant, whatever K and the batch."""
    counts = {}
    for batch, k in ((1, 2), (4, 2), (4, 5)):
        for temperature in (0.0, 0.8):
            engine, seqs = spec_engine(method, batch, k, temperature,
                                       mtp_weights() if method == "mtp" else None)
            while any(s.prefilling or s.slot is None for s in seqs):
                engine.step()
            engine.step()                     # a plain decode step: the MTP stash fills
            if method == "ngram":             # n-gram: drafts always (no backoff: a fixed drafter)
                engine.spec.drafter = type("Fixed", (), {"propose": lambda self, t, k: [1] * k})()
            engine.spec.backoff.clear()       # wholly rejected drafts: retry at once
            steps = engine.stats()["spec_verify_steps"]
            counts[(batch, k, temperature)] = reads_in_one_step(monkeypatch, engine)
            assert engine.stats()["spec_verify_steps"] == steps + batch   # all of them verified
    assert set(counts.values()) == {1 if method == "ngram" else 2}, counts


@pytest.mark.parametrize("chunk", [12, 40])         # window gather path / shared pool path
def test_host_reads_per_prefill_step_are_one(monkeypatch, chunk):
    """Steps that mix decode rows with prefill chunks (a long prompt through many chunks:
    windows read through the mirror, CSA/HCA entries pooled per chunk, snapshot captures,
    kvstore block copies) read the device once each, like a decode step: the sampled ids."""
    cfg = small_test_config()
    engine = make_engine(cfg, dtype="float32", truncation="compact", keep_tokens=22,
                         num_slots=3, max_running=3, num_blocks=96, max_batched_tokens=chunk + 2)
    engine.hooks = Recorder()
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=60, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(30 + 9 * i, i), params) for i in range(2)]
    while any(s.prefilling or s.slot is None for s in seqs):
        engine.step()
    new = engine.add_request(random_prompt(150, 9), params)
    counts = []
    while new.prefilling or new.slot is None:
        computed = new.num_computed
        counts.append(reads_in_one_step(monkeypatch, engine))
        assert new.num_computed > computed or new.num_computed == 0
    assert len(counts) >= 150 // (chunk + 2) and set(counts) == {1}, counts
    assert engine.stats()["snapshot_stores"] > 0 and engine.hooks.blocks   # captures, copies
