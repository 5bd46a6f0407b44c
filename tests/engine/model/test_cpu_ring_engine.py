"""The engine's decode rows (and an fp32 engine's prefill chunks) on the compiled CPU ring
kernel (kernels/cpu_ring.py): it is the path a CPU engine takes when the kernel builds, it
matches the full-sequence reference in float64 like the torch path, and an fp32 engine gives
the torch path's tokens."""

import pytest
import torch

from kernels import cpu_ring
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import reference
from tests.engine.core.test_equivalence import EXACT, max_logit_error
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

pytestmark = pytest.mark.skipif(cpu_ring._compiler() is None,
                                reason="no C compiler: the engine takes the torch path")


def _run(dtype, n=4, tokens=12):
    cfg = small_test_config()
    engine = make_engine(cfg, dtype=dtype, num_slots=n, max_batched_tokens=64)
    seqs = [engine.add_request(random_prompt(40 + 13 * i, 70 + i),
                               SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            for i in range(n)]
    run_to_completion(engine)
    return engine, cfg, seqs


def test_decodes_take_the_kernel_and_match_the_reference(monkeypatch):
    calls = []
    real = cpu_ring.union_attention
    monkeypatch.setattr(cpu_ring, "union_attention",
                        lambda q, scale, ring=None, table=None, sink=None, table2=None: calls.append(
                            (q.shape[0], ring is not None, table is not None))
                        or real(q, scale, ring, table, sink, table2))
    engine, cfg, seqs = _run("float64")
    # batched decode steps of all four went through it: ring alone (SWA layers) and ring plus
    # the compressed entries read in place (CSA, HCA layers)
    assert (4, True, False) in calls and (4, True, True) in calls, sorted(set(calls))
    for seq in seqs:
        assert max_logit_error(engine, cfg, seq) <= EXACT


def _error_vs_float64(engine, cfg, seq) -> float:
    """The fp32 engine's logits against the full-sequence reference run in float64 on the
    same (upcast, so identical) weights and the same tokens."""
    w64 = {k: v.double() for k, v in engine.weights.items()}
    tokens = seq.prompt + seq.output
    want = reference.forward(w64, cfg, tokens[:-1]).logits[len(seq.prompt) - 1:]
    return float((torch.stack(engine.logits[seq.request_id]).double() - want).abs().max())


def test_fp32_tokens_equal_the_torch_path(monkeypatch):
    """Greedy fp32: the kernel and torch's flash kernel over the fp32 mirror differ only in
    summation order. Over these prompts the tokens are the same, and the kernel's logits are
    as close to a float64 reference as the torch path's. (Neither is close to the other in
    absolute terms: an fp32 difference that moves a kv value across an E4M3 rounding
    boundary changes its code by 1/16 of its size, so both paths end 1e-5 to 2e-2 from
    float64 and 1e-4 to 1e-3 from each other, alike.) The fp32 engine's prefill chunks go
    through the kernel too (runner.PER_ROW_CHUNK): one call a chunk and layer, its window keys
    named by index (a table group) and, on CSA/HCA layers, its entries read in place beside
    them (a second one)."""
    calls = []
    real = cpu_ring.union_attention

    def spy(q, scale, ring=None, table=None, sink=None, table2=None):
        calls.append((q.shape[0], ring is not None, table is not None, table2 is not None))
        return real(q, scale, ring, table, sink, table2)

    monkeypatch.setattr(cpu_ring, "union_attention", spy)
    with_c, cfg, a = _run("float32")
    chunks = [c for c in calls if c[0] > 4 and not c[1]]
    assert any(c[2] and not c[3] for c in chunks), sorted(set(calls))       # SWA layers
    assert any(c[2] and c[3] for c in chunks), sorted(set(calls))           # CSA, HCA layers
    monkeypatch.setattr(cpu_ring, "union_attention", real)
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    plain, _, b = _run("float32")
    errors = []
    for x, y in zip(a, b, strict=True):
        assert x.output == y.output
        errors.append((_error_vs_float64(with_c, cfg, x), _error_vs_float64(plain, cfg, y)))
    # Compared over the prompts, not prompt by prompt: which path lands on the lucky side of
    # an E4M3 boundary for one prompt depends on the CPU's fp32 products (on an AVX-512 Xeon
    # one prompt read 4.5e-3 on the kernel against 1.2e-5 on torch, the others 1e-2 on both).
    worst_c, worst_torch = (max(e) for e in zip(*errors, strict=True))
    assert worst_c <= 1.1 * worst_torch + 1e-5, errors


def test_which_chunks_take_the_kernel_by_index():
    """runner._by_index: fp32 pool chunks up to PER_ROW_CHUNK rows and PER_ROW_ENTRIES rows x
    candidates; longer ones and float64 keys keep the shared pool."""
    from types import SimpleNamespace

    from services.engine.model import runner

    q32, q64 = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64, dtype=torch.float64)
    keys32, keys64 = torch.zeros(8, 64), torch.zeros(8, 64, dtype=torch.float64)
    step = SimpleNamespace(end_ids=[4096])                     # 1024 CSA candidates at m = 4
    rows = slice(100, 100 + runner.PER_ROW_CHUNK)
    assert runner._by_index(rows, q32, keys32, step, None)                 # SWA: no candidates
    assert runner._by_index(rows, q32, keys32, step, 128)
    assert not runner._by_index(slice(0, runner.PER_ROW_CHUNK + 1), q32, keys32, step, None)
    assert not runner._by_index(rows, q64, keys64, step, None)             # float64: the pool
    long = SimpleNamespace(end_ids=[4 * (runner.PER_ROW_ENTRIES // runner.PER_ROW_CHUNK + 1)])
    assert not runner._by_index(rows, q32, keys32, long, 4)                # index too large
    assert runner._by_index(slice(0, 16), q32, keys32, long, 4)
