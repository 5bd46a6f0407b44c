"""Training the shipped DeepSeek V4.1 model (training/v41_*.py): the training
forward computes V41Model's function, the indexer loss trains only the indexer, the gate
biases move towards equal loads, and `kvmesh train` lowers the loss, resumes to the same
weights as an unbroken run, and writes a checkpoint directory the loader reads back."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.v41_config import v41_config_from_dict
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.training import bpe, data, v41_data, v41_evaluate
from kvmesh.training.v41_loop import V41TrainArgs, starting_weights, step_loss, train_v41
from kvmesh.training.v41_model import balance, forward, initial_weights, shipped_config
from tests.engine.deepseek_v41 import tiny


@pytest.mark.parametrize("name", ["flash_like", "yarn_hc4"])
def test_training_forward_is_the_reference_function(name):
    cfg = tiny.config(name)
    model = V41Model(cfg, tiny.weights(cfg, seed=2), torch.float64)
    ids = tiny.prompt(name)
    out = forward(model, ids)
    assert torch.equal(out.logits, model.logits(ids))
    assert float(out.indexer_kl) > 0       # random indexers disagree with the attention
    assert [int(x.sum()) for x in out.loads] == [len(ids) * cfg.experts_per_token] * cfg.num_layers


def _grads(model, loss) -> set[str]:
    for t in model.weights.values():
        t.grad = None
    loss.backward()
    return {k for k, t in model.weights.items() if t.grad is not None and bool(t.grad.abs().sum())}


def test_the_indexer_loss_trains_only_the_indexers():
    cfg = tiny.config("flash_like")
    w = {k: t.requires_grad_(True) for k, t in tiny.weights(cfg, seed=3).items()}
    model = V41Model(cfg, w, torch.float64)
    ids = tiny.prompt("flash_like")
    kl_grads = _grads(model, forward(model, ids).indexer_kl)
    assert kl_grads and all(".attn.indexer." in k for k in kl_grads), sorted(kl_grads)
    # every index source's query side learns; key sides live on the KV sources (1 and 3)
    for i in cfg.index_sources:
        assert f"layers.{i}.attn.indexer.wq_b.weight" in kl_grads
    assert {f"layers.{i}.attn.indexer.wk.weight" for i in cfg.kv_sources} <= kl_grads
    lm_grads = _grads(model, F.cross_entropy(forward(model, ids).logits[:-1], ids[1:]))
    assert not any(".attn.indexer." in k for k in lm_grads)   # top-k passes no gradient
    assert "layers.1.attn.compressor.wkv.weight" in lm_grads


def test_a_few_indexer_steps_bring_it_towards_the_attention():
    cfg = tiny.config("flash_like")
    w = {k: t.requires_grad_(True) for k, t in tiny.weights(cfg, seed=4).items()}
    model = V41Model(cfg, w, torch.float64)
    ids = tiny.prompt("flash_like")
    opt = torch.optim.Adam([t for k, t in w.items() if ".indexer." in k], lr=3e-2)
    kls = []
    for _ in range(15):
        kl = forward(model, ids).indexer_kl
        opt.zero_grad()
        kl.backward()
        opt.step()
        kls.append(kl.item())
    print("indexer KL", [round(k, 4) for k in kls])
    assert kls[-1] < 0.5 * kls[0]


def test_balance_moves_the_bias_towards_equal_loads():
    cfg = tiny.config("flash_like")
    w = {k: torch.zeros_like(t) if k.endswith("gate.bias") else t
         for k, t in tiny.weights(cfg).items()}
    loads = [torch.tensor([10, 2, 4, 4])] * cfg.num_layers
    balance(w, cfg, loads, rate=0.01)
    assert w["layers.0.ffn.gate.bias"].tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_the_shipped_shape_is_the_designs():
    cfg = v41_config_from_dict(shipped_config())
    assert cfg.window == 128 and sorted(set(cfg.ratios) - {0}) == [4, 128]
    assert cfg.hc_mult >= 2 and cfg.n_experts > cfg.experts_per_token
    assert cfg.decoder_start is not None and cfg.decoder_start < cfg.num_layers - 1
    n = sum(t.numel() for t in initial_weights(cfg, 0).values())
    assert 2 * n < 40 * 2**20            # bf16 on disk, under the 40 MiB the issue allows


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few real files of each kind, some held out, and a tokenizer trained on them."""
    chosen = {}
    for kind, (root, files) in v41_data.sources().items():
        if kind == "chat":   # files with enough conversations for a window or two
            files = [f for f in files if len(list(v41_data.texts(root, [f], kind))) > 20]
        held = [f for f in files if data.is_held_out(f)][:2]
        train = [f for f in files if not data.is_held_out(f)][:12]
        assert held and train, kind
        chosen[kind] = (root, sorted(train + held))
    directory = tmp_path_factory.mktemp("tok")
    texts = [t for kind, (root, files) in chosen.items() for t in v41_data.texts(root, files, kind)]
    bpe.save(bpe.train(texts, vocab_size=600), directory)
    return chosen, directory


def _args(out, tokenizer, **kw) -> V41TrainArgs:
    base = dict(out=str(out), tokenizer=str(tokenizer), steps=10, batch=4, seq_len=64, lr=1e-2,
                warmup=1, log_every=1, eval_every=5, eval_windows=1, chat_fraction=0.2)
    return V41TrainArgs(**{**base, **kw})


def test_train_v41_lowers_the_loss_resumes_and_writes_a_loadable_checkpoint(
        small_corpus, tmp_path, monkeypatch):
    chosen, tokenizer = small_corpus
    monkeypatch.setattr(v41_data, "sources", lambda: chosen)
    whole = train_v41(_args(tmp_path / "whole", tokenizer))
    assert whole["step"] == 10
    train_v41(_args(tmp_path / "split", tokenizer, time_budget_min=1e-9))  # stops at step 1
    resumed = train_v41(_args(tmp_path / "split", tokenizer, resume=True))
    assert resumed["step"] == 10
    a = torch.load(tmp_path / "whole" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "state.pt", weights_only=False)
    for k, t in a["weights"].items():
        assert torch.equal(t, b["weights"][k]), k

    run = tmp_path / "whole"
    losses = [h["loss"] for h in a["history"] if "loss" in h]
    print("train losses", losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3
    assert {p.name for p in run.iterdir()} >= {"config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}
    assert json.loads((run / "config.json").read_text())["text_config"]["vocab_size"] == 600
    cfg, w = load_v41_checkpoint(run, torch.float32)
    trained = {k: t.bfloat16().float() for k, t in a["weights"].items()}
    ids = torch.randint(0, cfg.vocab_size, (40,))
    assert torch.equal(V41Model(cfg, w, torch.float32).logits(ids),
                       V41Model(cfg, trained, torch.float32).logits(ids))

    # a second phase starts from it (--init-from), and refuses another shape
    again = starting_weights(cfg, _args(tmp_path / "phase2", tokenizer, init_from=str(run)),
                             print)
    assert all(torch.equal(again[k], w[k]) for k in w)
    other = v41_config_from_dict(shipped_config(vocab_size=600, hidden_size=128))
    with pytest.raises(ValueError, match="--init-from"):
        starting_weights(other, _args(tmp_path / "phase2", tokenizer, init_from=str(run)), print)

    # `kvmesh train-eval RUN_DIR` measures it, code and English apart
    m = v41_evaluate.evaluate(str(run), windows=3, seq_len=520, cut_stride=4)
    for kind in v41_data.KINDS:
        k = m[kind]
        assert k["held_out_files"] == 2 and k["windows"] == min(3, k["held_out_tokens"] // 521)
        assert k["predictions"] == 520 * k["windows"] and k["beyond_window"]["n"] == 2 * k["windows"]
        assert 0 < k["bits_per_byte"] < 20 and 0 < k["byte_unigram_bits_per_byte"] < 8
        bw = k["beyond_window"]
        assert bw["gap_bits_per_byte"] == pytest.approx(
            bw["cut_to_window_bits_per_byte"] - bw["full_context_bits_per_byte"], abs=1e-12)


def test_evaluation_windows_do_not_overlap():
    stream = torch.arange(100)
    win = v41_evaluate.windows_of(stream, 8, 19)
    assert win.shape == (5, 20) and len(set(win.reshape(-1).tolist())) == 100
    with pytest.raises(ValueError, match="shorter than one window"):
        v41_evaluate.windows_of(stream, 2, 100)


def test_copy_rows_repeat_a_snippet_longer_than_the_window():
    gen = torch.Generator().manual_seed(0)
    window = torch.arange(1000, 1601, dtype=torch.int16)        # 601 distinct tokens
    for _ in range(20):
        row = v41_data.copy_row(window, [7, 8], 144, gen)
        assert len(row) == len(window) and row.dtype == window.dtype
        s = int((row == 7).nonzero()[0])                         # where the separator is
        assert 144 <= s <= (601 - 2) // 2 and row[s + 1] == 8
        assert torch.equal(row[:s], window[:s]) and torch.equal(row[s + 2: 2 * s + 2], window[:s])
        assert torch.equal(row[2 * s + 2:], window[s: 601 - s - 2])   # then the text goes on
    with pytest.raises(ValueError, match="no room for two snippets"):
        v41_data.copy_row(window[:200], [7, 8], 144, gen)
    corpus = v41_data.TokenCorpus({k: window for k in v41_data.KINDS}, {}, {})
    rows = v41_data.sample(corpus, 40, 590, 0.0, 0.0, gen, 0.5, ([7, 8], 144))
    copies = sum(bool((r == 7).any()) for r in rows)
    assert 10 <= copies <= 30 and all(len(r) == 591 for r in rows)


def test_train_v41_refuses_a_missing_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer"):
        train_v41(V41TrainArgs(out=str(tmp_path), tokenizer=str(tmp_path / "none")))


def test_step_loss_averages_the_rows():
    cfg = v41_config_from_dict(shipped_config(vocab_size=300, num_hidden_layers=3,
                                              compress_ratios=[0, 128, 4],
                                              kv_source_layer_ids=[1, 2],
                                              index_source_layer_ids=[1, 2],
                                              candidate_source_layer_id=2))
    model = V41Model(cfg, initial_weights(cfg, 0), torch.float32)
    rows = [torch.randint(0, 300, (33,)) for _ in range(2)]
    loss, lm, kl, loads = step_loss(model, rows, kl_weight=0.5)
    each = [forward(model, r[:-1]) for r in rows]
    lms = [float(F.cross_entropy(o.logits, r[1:])) for o, r in zip(each, rows, strict=True)]
    assert lm == pytest.approx(sum(lms) / 2, rel=1e-5)
    assert float(loss) == pytest.approx(lm + 0.5 * kl, rel=1e-5)
    assert [int(x.sum()) for x in loads] == [2 * 32 * cfg.experts_per_token] * 3


def test_conversations_come_from_public_docstrings():
    from pathlib import Path

    source = '''
def parse(text):
    """Parse the text into a tree of nodes.

    Details that the answer leaves out."""

def _hidden():
    """A private helper nobody asks about."""

class Reader:
    """Reads records one at a time from a file."""
    def next_record(self):
        """Return the next record, or None at the end."""
    def undocumented(self):
        pass
'''
    chats = v41_data.conversations(Path("pkg/__init__.py"), source)
    assert chats == [
        "<｜begin▁of▁sentence｜><｜User｜>What does the function `pkg.parse` do?<｜Assistant｜>"
        "</think>Parse the text into a tree of nodes.",
        "<｜begin▁of▁sentence｜><｜User｜>What does the class `pkg.Reader` do?<｜Assistant｜>"
        "</think>Reads records one at a time from a file.",
        "<｜begin▁of▁sentence｜><｜User｜>What does the method `pkg.Reader.next_record` do?"
        "<｜Assistant｜></think>Return the next record, or None at the end."]
    assert v41_data.conversations(Path("bad.py"), "def (:") == []
