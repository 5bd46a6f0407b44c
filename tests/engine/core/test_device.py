"""Device placement (`--device`): every engine tensor on the configured device, a clear
start-up error when CUDA is asked for and missing, and (gpu-marked) the engine on CUDA
against the same engine on the CPU."""

import pytest
import torch

from services.engine import device as device_mod
from services.engine.config import EngineConfig, small_test_config
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model import weights as weights_mod
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()


def engine_tensors(engine: EngineCore):
    """(name, tensor) of every tensor the engine keeps across steps: weights, state pool
    (the slab and each ring view), block store, replica area, the runner's window mirror."""
    yield from (("weights." + k, v) for k, v in engine.weights.items())
    states = engine.cache.states
    yield "states.data", states.data
    for kind in ("swa", "cmp", "idx"):
        yield from ((f"states.{kind}.{k}", v) for k, v in getattr(states, kind).items())
    store = engine.cache.store
    yield from ((f"store.entries.{k}", v) for k, v in store.entries.items())
    yield from ((f"store.index_keys.{k}", v) for k, v in store.index_keys.items())
    yield "prefix.replica", engine.prefix.replica
    mirror = engine.runner.mirror
    yield from ((f"mirror.values.{k}", v) for k, v in mirror.values.items())
    yield from ((f"mirror.pos.{k}", v) for k, v in mirror.pos.items())


def test_every_engine_tensor_lives_on_the_configured_device():
    engine = make_engine(CFG, num_slots=2, num_blocks=64, device="cpu", truncation="compact",
                         keep_tokens=30)
    seq = engine.add_request(random_prompt(70, 1), SamplingParams(temperature=0.7, max_tokens=5,
                                                                      ignore_eos=True))
    run_to_completion(engine)
    assert len(seq.output) == 5
    names = [name for name, t in engine_tensors(engine)]
    assert len(names) > 40 and "prefix.replica" in names
    wrong = [(name, t.device) for name, t in engine_tensors(engine) if t.device != engine.device]
    assert engine.device == torch.device("cpu") and not wrong, wrong


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_start_up_error_naming_the_flag():
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device"):
        EngineCore(CFG, EngineConfig(num_slots=1, num_blocks=16, device="cuda"))


def test_bad_device_value_is_refused():
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(device="tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_matches_the_cpu_engine():
    """Same weights, same requests (a long prompt, then one sharing its blocks: a cache hit),
    greedy: the same tokens, logits within 1e-9 in float64 (float64 always takes the torch
    kernels, so this checks the placement, not Triton) and every engine tensor on the GPU."""
    dtype = "float64"
    w = weights_mod.init_weights(CFG, 0, torch.float64)
    runs = {}
    for device in ("cpu", "cuda"):
        engine = make_engine(CFG, dtype=dtype, weights=w, device=device, num_slots=2, num_blocks=64)
        outs = []
        for prompt in (random_prompt(300, 5), random_prompt(300, 5)[:260] + random_prompt(20, 6)):
            seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
            run_to_completion(engine)
            outs.append((seq.output, torch.stack(engine.logits[seq.request_id]).cpu()))
        assert engine.counters["cache_hit_tokens"] > 0
        if device == "cuda":
            wrong = [name for name, t in engine_tensors(engine) if t.device.type != "cuda"]
            assert not wrong, wrong
        runs[device] = outs
    for (tok_c, log_c), (tok_g, log_g) in zip(runs["cpu"], runs["cuda"], strict=True):
        assert tok_c == tok_g
        assert float((log_c - log_g).abs().max()) <= 1e-9


def test_host_copies_deliver_in_order_and_do_not_wait_on_the_cpu():
    got = []
    copies = device_mod.HostCopies(torch.device("cpu"))
    for i in range(3):
        copies.submit(torch.full((5,), i, dtype=torch.uint8), got.append)
    assert got == [bytes([i]) * 5 for i in range(3)] and copies.pending == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_copies_on_cuda_are_pinned_non_blocking_and_stream_ordered():
    """submit returns before the bytes are read; a later write to the source (queued after
    the copy) does not reach the copy; poll(wait=True) delivers everything, in order."""
    got = []
    copies = device_mod.HostCopies(torch.device("cuda"))
    src = torch.zeros(1 << 24, dtype=torch.uint8, device="cuda")
    for i in range(4):
        src.fill_(i + 1)
        copies.submit(src, got.append)
    src.fill_(99)                                   # queued after the copies
    assert copies.poll(wait=True) == 4 and copies.pending == 0
    assert [set(b) for b in got] == [{1}, {2}, {3}, {4}]


def test_step_uploads_make_long_tensors_and_count_late_ones():
    up = device_mod.Uploads(torch.device("cpu"))
    a, table, empty = up.many([3, 1, 2], [[1, 2], [3, 4]], [])
    assert a.tolist() == [3, 1, 2] and table.tolist() == [[1, 2], [3, 4]] and empty.numel() == 0
    assert a.dtype == table.dtype == torch.long and (up.count, up.late) == (1, 0)
    up.seal()
    assert up.longs([7]).tolist() == [7] and (up.count, up.late) == (2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_uploads_on_cuda_go_up_in_one_pinned_copy():
    up = device_mod.Uploads(torch.device("cuda"))
    lists = ([5, 6, 7], [[1, 2, 3], [4, 5, 6]], [], list(range(1000)))
    got = up.many(*lists)
    assert all(t.device.type == "cuda" and t.dtype == torch.long for t in got)
    assert got[0].data_ptr() + 3 * 8 == got[1].data_ptr()            # one buffer, one copy
    assert [t.tolist() for t in got] == [list(x) for x in lists]
