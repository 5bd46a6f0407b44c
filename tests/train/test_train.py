"""Training: the differentiable forward computes the reference's function, a few steps
lower the loss, and a saved checkpoint round-trips through the engine's loader."""

import math

import pytest
import torch

from services.engine.config import small_test_config
from services.engine.model import reference
from services.engine.model import weights as weights_mod
from training import data
from training.loop import TrainArgs, batch_loss, make_optimizer, save_checkpoint
from training.model import forward

EXACT = 1e-9      # float64, MXFP8 on both sides: the same function up to reduction order


def _snippet(n: int) -> list[int]:
    """Real Python bytes: the start of this very file, repeated to length n."""
    text = open(__file__, "rb").read()
    return list((text * (n // len(text) + 1))[:n])


@pytest.mark.parametrize("t", [37, 96])
def test_training_forward_is_the_reference_function(t):
    """Same weights, same MXFP8 SWA KV: the chunked, batched training forward gives the
    reference's logits (T not a multiple of the chunk exercises the padding)."""
    cfg = small_test_config()
    w = weights_mod.init_weights(cfg, seed=3, dtype=torch.float64)
    tokens = torch.tensor(_snippet(t))
    want = reference.forward(w, cfg, tokens).logits
    got, kl = forward(w, cfg, tokens[None], chunk=8, quantize=True)
    assert float((got[0] - want).abs().max()) < EXACT
    assert float(kl) > 0          # the indexer has not been trained toward the main attention


def test_unquantized_forward_stays_within_mxfp8_error():
    """Training runs without MXFP8: its logits differ from the served ones by the quantization
    error only (measured 0.35 on random weights, which amplify it most; a wrong forward is O(10))."""
    cfg = small_test_config()
    w = weights_mod.init_weights(cfg, seed=4, dtype=torch.float64)
    tokens = torch.tensor(_snippet(64))
    served = reference.forward(w, cfg, tokens).logits
    trained, _ = forward(w, cfg, tokens[None], chunk=16)
    err = float((trained[0] - served).abs().max())
    print(f"unquantized vs MXFP8 logits: max |diff| {err:.3f}")
    assert 0 < err < 1.0


def test_a_few_steps_lower_the_loss_and_the_checkpoint_loads_in_the_engine(tmp_path):
    torch.manual_seed(0)
    cfg = small_test_config()
    a = TrainArgs(out=str(tmp_path), lr=1e-2, warmup=1, steps=8, bf16=False, chunk=16)
    w = {k: t.requires_grad_(True) for k, t in weights_mod.init_weights(cfg, seed=0).items()}
    opt = make_optimizer(w, a)
    batch = torch.tensor(_snippet(2 * 129)).view(2, 129)
    losses = []
    for _ in range(a.steps):
        loss, lm, _ = batch_loss(w, cfg, batch, a)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(lm.item())
    assert losses[-1] < 0.7 * losses[0], losses

    save_checkpoint(tmp_path, w, opt, a.steps, torch.Generator(), 0.0, a, cfg, [])
    loaded = weights_mod.load(tmp_path / "model.safetensors", cfg)
    assert all(torch.equal(loaded[k], w[k].detach()) for k in w)


def test_held_out_split_is_by_file_and_large_enough():
    files = [data.Path(f"pkg/mod{i}.py") for i in range(2000)]
    train, val = data.split(files)
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    assert len(val) >= 0.02 * len(files)
    assert val == [f for f in files if data.is_held_out(f)]       # depends on the name only
    stream = torch.tensor([1, 2, 3, 1], dtype=torch.int16)
    # add-one unigram over 4 symbols + 256 unseen: p(1) = 3 / 264
    assert math.isclose(data.unigram_bits(stream, torch.tensor([1]), 260), -math.log2(3 / 264))


def test_decay_by_time_anneals_a_budget_stopped_run():
    """With --decay-by-time the cosine follows the elapsed share of the time budget when that
    is further along than the steps, so a run stopped by its budget ends at min_lr_frac."""
    from training.loop import lr_at

    a = TrainArgs(lr=1e-3, warmup=10, steps=1000, min_lr_frac=0.1, time_budget_min=10.0)
    timed = TrainArgs(**{**a.__dict__, "decay_by_time": True})
    assert lr_at(5, timed, elapsed=599.0) == lr_at(5, a)                  # warm-up: by step
    assert lr_at(100, a, elapsed=600.0) > 0.9e-3                          # by step: barely decayed
    assert math.isclose(lr_at(100, timed, elapsed=600.0), 1e-4)           # budget spent: the floor
    assert math.isclose(lr_at(505, timed, elapsed=60.0), lr_at(505, a))   # steps further along
