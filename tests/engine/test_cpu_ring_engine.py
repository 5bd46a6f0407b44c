"""The engine's decode rows on the compiled CPU ring kernel (kernels/cpu_ring.py): it is the
path a CPU engine takes when the kernel builds, it matches the full-sequence reference in
float64 like the torch path, and an fp32 engine gives the torch path's tokens."""

import pytest
import torch

from kernels import cpu_ring
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion
from tests.engine.test_equivalence import EXACT, max_logit_error

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
    monkeypatch.setattr(cpu_ring, "union_attention", lambda q, scale, ring=None, table=None: calls.append(
        (q.shape[0], ring is not None, table is not None)) or real(q, scale, ring, table))
    engine, cfg, seqs = _run("float64")
    # batched decode steps of all four went through it: ring alone (SWA layers) and ring plus
    # the compressed entries read in place (CSA, HCA layers)
    assert (4, True, False) in calls and (4, True, True) in calls, sorted(set(calls))
    for seq in seqs:
        assert max_logit_error(engine, cfg, seq) <= EXACT


def test_fp32_tokens_equal_the_torch_path(monkeypatch):
    """Greedy fp32: the kernel and torch's flash kernel over the fp32 mirror differ only in
    summation order; over these prompts the tokens are the same and the logits within 1e-4."""
    with_c, _, a = _run("float32")
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    plain, _, b = _run("float32")
    for x, y in zip(a, b, strict=True):
        assert x.output == y.output
        la = torch.stack(with_c.logits[x.request_id])
        lb = torch.stack(plain.logits[y.request_id])
        assert float((la - lb).abs().max()) <= 1e-4
