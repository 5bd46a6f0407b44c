"""`kvmesh train-mtp`: a few MTP steps lower its loss on a frozen trunk; the written checkpoint
carries the base's trunk tensors bit for bit plus mtp.*; a resumed run equals an
uninterrupted one (deterministic for a seed)."""

import torch

from services.engine.config import TINY, small_test_config
from services.engine.model import mtp
from services.engine.model import weights as weights_mod
from training.mtp import MtpArgs, mtp_loss, train_mtp


def _snippet(n: int) -> torch.Tensor:
    text = open(__file__, "rb").read()
    return torch.tensor(list((text * (n // len(text) + 1))[:n]))


def test_a_few_mtp_steps_lower_its_loss_and_leave_the_trunk_alone():
    torch.manual_seed(0)
    cfg = small_test_config()
    w = weights_mod.init_weights(cfg, seed=0, mtp=True)
    trunk = {k: t.clone() for k, t in w.items() if not k.startswith(mtp.PREFIX)}
    params = [w[k].requires_grad_(True) for k in mtp.shapes(cfg)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = _snippet(2 * 66).view(2, 66)           # 64 MTP positions per row
    losses = []
    for _ in range(8):
        loss = mtp_loss(w, cfg, batch, chunk=16, bf16=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(w[k], t) for k, t in trunk.items())


def test_checkpoint_keeps_the_trunk_bit_identical_and_resume_equals_one_run(tmp_path):
    base = weights_mod.init_weights(TINY, seed=1)
    weights_mod.save(base, TINY, tmp_path / "base.safetensors")
    common = dict(base=str(tmp_path / "base.safetensors"), seq_len=64, eval_every=100,
                  eval_windows=1, log_every=1, warmup=1)
    train_mtp(MtpArgs(out=str(tmp_path / "one"), steps=3, **common))
    train_mtp(MtpArgs(out=str(tmp_path / "two"), steps=3, minutes=1e-9, **common))   # stops at 1
    train_mtp(MtpArgs(out=str(tmp_path / "two"), steps=3, resume=True, **common))
    one = weights_mod.load(tmp_path / "one" / "model.safetensors", TINY)
    two = weights_mod.load(tmp_path / "two" / "model.safetensors", TINY)
    assert all(torch.equal(one[k], base[k]) for k in base)
    assert set(one) == set(base) | set(mtp.shapes(TINY))
    assert all(torch.equal(one[k], two[k]) for k in one)
    log = (tmp_path / "two" / "train.log").read_text()
    assert "resumed from" in log and "tok/s" in log and "mtp loss" in log


def test_chained_training_forward_is_the_engines_second_draft():
    """Depth 2 in training (train/mtp_chain.py, teacher forced, MXFP8 like the ring) gives the
    logits the engine's chained row computes: the reference chain of test_mtp.py, float64."""
    from services.engine.model import reference
    from tests.engine.core.test_mtp import CFG, EXACT, W64, reference_chain
    from training.mtp_chain import chained, depth1

    tokens = _snippet(40).tolist()
    t = 32
    h = reference.forward(W64, CFG, torch.tensor(tokens[: t + 1])).hidden
    toks = torch.tensor(tokens)
    y1, kv1 = depth1(W64, CFG, h[None, :t], toks[None, 1 : t + 1], chunk=8, quantize=True)
    first = mtp.logits(W64, CFG, y1)[0]
    second = chained(W64, CFG, y1, kv1, toks[None, 2 : t + 2], chunk=8, quantize=True)[0]
    for c in (16, 17, 18, 23, 30):
        want, _ = reference_chain(tokens, c, [tokens[c + 1], 0])
        assert float((first[c - 1] - want[0]).abs().max()) <= EXACT, c
        assert float((second[c - 1] - want[1]).abs().max()) <= EXACT, c


def test_depth_two_training_lowers_both_losses():
    torch.manual_seed(0)
    cfg = small_test_config()
    w = weights_mod.init_weights(cfg, seed=0, mtp=True)
    params = [w[k].requires_grad_(True) for k in mtp.shapes(cfg)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = _snippet(2 * 67).view(2, 67)
    losses = []
    for _ in range(6):
        loss = mtp_loss(w, cfg, batch, chunk=16, bf16=False, depth=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses
