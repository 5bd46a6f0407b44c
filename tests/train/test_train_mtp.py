"""`kvmesh train-mtp` (training/v41_mtp.py): kvmesh's MTP module trained on a frozen DeepSeek
V4.1 trunk lowers its loss to the trunk's next-next distribution, resumes to the same
weights as an unbroken run, leaves the trunk's tensors exactly as they were, and writes a
checkpoint an engine drafts from with `--speculative mtp:K` (output unchanged)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.v41_config import v41_config_from_dict
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule
from kvmesh.training import v41_data
from kvmesh.training.v41_loop import save_hf
from kvmesh.training.v41_model import initial_weights, shipped_config
from kvmesh.training.v41_mtp import MtpTrainArgs, initial_mtp_weights, mtp_loss, train_mtp
from tests.engine.deepseek_v4.test_engine import engine, run
from tests.train.test_train_v41 import small_corpus  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def trunk(small_corpus, tmp_path_factory):  # noqa: F811
    """A shipped-shape trunk at its initial weights, with the small corpus's tokenizer."""
    _, tokenizer = small_corpus
    directory = tmp_path_factory.mktemp("trunk")
    raw = shipped_config(vocab_size=600)
    save_hf(directory, raw, initial_weights(v41_config_from_dict(raw), 0))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    return directory


def _args(out, trunk, **kw) -> MtpTrainArgs:
    base = dict(out=str(out), trunk=str(trunk), steps=10, batch=2, seq_len=64, lr=1e-2,
                warmup=1, log_every=1, eval_every=5, eval_windows=1)
    return MtpTrainArgs(**{**base, **kw})


def test_the_loss_is_a_cross_entropy_to_the_trunks_next_next_token():
    raw = shipped_config(vocab_size=50, hidden_size=32, moe_intermediate_size=16, q_lora_rank=16,
                         o_lora_rank=8, index_head_dim=16, num_hidden_layers=3,
                         compress_ratios=[0, 4, 4], kv_source_layer_ids=[1],
                         index_source_layer_ids=[1, 2], candidate_source_layer_id=1,
                         kvmesh={"mtp_layers": 1})
    cfg = v41_config_from_dict(raw)
    trunk_w = {k: v.double() for k, v in initial_weights(cfg, 1).items()}
    mtp_w = {k: v.double() for k, v in initial_mtp_weights(cfg, 2).items()}
    trunk = V41Model(cfg, trunk_w, torch.float64)
    module = V41MtpModule(V41Model(cfg, {**trunk_w, **mtp_w}, torch.float64))
    row = torch.randint(0, 50, (21,))
    loss, logits, logp = mtp_loss(module, trunk, row)
    full = trunk.logits(row[:-1]).log_softmax(dim=-1)      # the trunk's row p + 1
    assert torch.allclose(logp, full[1:].float(), atol=1e-5) and logits.shape == (19, 50)
    assert float(loss) == pytest.approx(float(F.cross_entropy(logits, logp.exp())), rel=1e-6)
    # row p reads tokens up to p + 1: changing token 10 leaves rows 0-8 alone, moves row 9
    other = row.clone()
    other[10] = (row[10] + 1) % 50
    _, moved, _ = mtp_loss(module, trunk, other)
    assert torch.equal(moved[:9], logits[:9]) and not torch.equal(moved[9], logits[9])


def test_train_mtp_lowers_the_loss_resumes_and_keeps_the_trunk(small_corpus, trunk, tmp_path,  # noqa: F811
                                                               monkeypatch):
    chosen, _ = small_corpus
    monkeypatch.setattr(v41_data, "sources", lambda: chosen)
    whole = train_mtp(_args(tmp_path / "whole", trunk))
    assert whole["step"] == 10
    train_mtp(_args(tmp_path / "split", trunk, time_budget_min=1e-9))     # stops at step 1
    assert train_mtp(_args(tmp_path / "split", trunk, resume=True))["step"] == 10
    a = torch.load(tmp_path / "whole" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "state.pt", weights_only=False)
    for k, t in a["weights"].items():
        assert k.startswith("kvmesh.mtp.0.") and torch.equal(t, b["weights"][k]), k
    losses = [h["loss"] for h in a["history"] if "loss" in h]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses
    evals = [h for h in a["history"] if "val_code_agree" in h]
    assert evals and all(0 <= h["val_code_agree"] <= 1 for h in evals)

    out = tmp_path / "whole"
    assert json.loads((out / "config.json").read_text())["text_config"]["kvmesh"] == {"mtp_layers": 1}
    cfg, w = load_v41_checkpoint(out, torch.float32)
    _, before = load_v41_checkpoint(trunk, torch.float32)
    assert cfg.mtp_layers == 1
    assert all(torch.equal(w[k], before[k]) for k in before)          # the trunk is untouched
    assert {k for k in w if k not in before} == set(a["weights"])

    # the engine drafts from it; greedy output is the trunk's own
    prompt = list(range(3, 90))
    plain = run(engine(out), [prompt], 12)
    core = engine(out, "--speculative", "mtp:2", "--spec-policy", "always")
    assert run(core, [prompt], 12) == plain and core.stats()["spec_drafted_tokens"] > 0


def test_train_mtp_refuses_a_missing_trunk_and_one_that_has_a_module(trunk, tmp_path):
    with pytest.raises(ValueError, match="--trunk"):
        train_mtp(_args(tmp_path / "x", tmp_path / "nowhere"))
    raw = json.loads((trunk / "config.json").read_text())
    raw["text_config"]["kvmesh"] = {"mtp_layers": 1}
    has = tmp_path / "has"
    shutil.copytree(trunk, has)
    (has / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="already has an MTP module"):
        train_mtp(_args(tmp_path / "y", has))
