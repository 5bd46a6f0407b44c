"""Each piece against the transformers module it re-implements, on the same weights and the
same inputs (captured with forward hooks during transformers' own float64 forward), so a
parity failure names its piece: hyper-connections, attention, compressor, indexer, MoE,
hc_head."""

from __future__ import annotations

import pytest
import torch

from services.engine.model.deepseek_v4 import compressor, hyper
from services.engine.model.deepseek_v4.attention import attention
from services.engine.model.deepseek_v4.config import CSA, SLIDING
from services.engine.model.deepseek_v4.moe import moe
from services.engine.model.deepseek_v4.score import load_model
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
TOL = 1e-10  # float64; bitwise today


@pytest.fixture(scope="module", params=["mixed", "topk_nested_yarn"])
def captured(request, tmp_path_factory):
    """(our model, ids, {(module path): (args, kwargs, output)}) from one transformers forward."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    hf = tiny.save(name, directory).double()
    seen, hooks = {}, []
    for path, module in hf.model.named_modules():
        if path.endswith(("attn_hc", "ffn_hc", "self_attn", "compressor", "indexer", "mlp",
                          "hc_head")):
            def hook(mod, args, kwargs, output, path=path):
                seen[path] = (args, kwargs, output)
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    ids = tiny.prompt(name)
    with torch.no_grad():
        hf(ids.view(1, -1), use_cache=False)
    for h in hooks:
        h.remove()
    return load_model(directory, torch.float64), ids, seen


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_hyper_connection_weights_and_collapse(captured):
    model, _, seen = captured
    for i, w in enumerate(model.layers):
        for name, ours in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            (streams,), _, (post, comb, collapsed) = seen[f"layers.{i}.{name}"]
            pre, got_post, got_comb = hyper.mix_weights(
                streams[0], w[f"{ours}_fn"], w[f"{ours}_base"], w[f"{ours}_scale"],
                model.cfg.hc_sinkhorn_iters, model.cfg.hc_eps, model.cfg.rms_eps)
            _close(got_post, post[0])
            _close(got_comb, comb[0])
            _close(hyper.collapse(streams[0], pre), collapsed[0])


def test_hc_head(captured):
    model, _, seen = captured
    (streams,), _, out = seen["hc_head"]
    w = model.weights
    _close(hyper.head_collapse(streams[0], w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"],
                               model.cfg.hc_eps, model.cfg.rms_eps), out[0])


def test_attention_compressor_and_indexer(captured):
    model, ids, seen = captured
    positions = torch.arange(len(ids))
    for i, kind in enumerate(model.cfg.layer_kinds):
        args, kwargs, out = seen[f"layers.{i}.self_attn"]
        x = (args[0] if args else kwargs["hidden_states"])[0]
        w = {k[len("attn."):]: v for k, v in model.layers[i].items() if k.startswith("attn.")}
        parts = attention(model.cfg, i, w, x, positions, model.tables)
        _close(parts.out, out[0][0])
        if kind == SLIDING:
            continue
        _close(parts.pooled.entries, seen[f"layers.{i}.self_attn.compressor"][2][0][0, 0])
        if kind == CSA:
            picks = seen[f"layers.{i}.self_attn.compressor.indexer"][2][0]    # [S, k], -1 = none
            want = torch.zeros_like(parts.chosen)
            for s, row in enumerate(picks):
                want[s, row[row >= 0]] = True
            assert torch.equal(parts.chosen, want)
            assert parts.chosen.sum(dim=1).max() <= model.cfg.index_topk


def test_moe_block(captured):
    model, ids, seen = captured
    for i in range(model.cfg.num_layers):
        args, kwargs, out = seen[f"layers.{i}.mlp"]
        x = (args[0] if args else kwargs["hidden_states"])[0]
        w = {k[len("ffn."):]: v for k, v in model.layers[i].items() if k.startswith("ffn.")}
        _close(moe(model.cfg, i, w, x, ids), out[0])


def test_compressor_keeps_the_open_window_and_overlap():
    """What a cache needs beside the entries: the raw tail of the open window, and (CSA) the
    last closed window's A series, which the next entry pools."""
    torch.manual_seed(0)
    d, D, m, S = 8, 16, 4, 11
    w = {"wkv.weight": torch.randn(2 * d, D), "wgate.weight": torch.randn(2 * d, D),
         "ape": torch.randn(m, 2 * d), "norm.weight": torch.ones(d)}
    x = torch.randn(S, D)
    no_rope = lambda p: (torch.ones(len(p), 1), torch.zeros(len(p), 1))  # noqa: E731
    full = compressor.pool(x, w, m, True, 0, no_rope, 1e-6)
    assert full.entries.shape == (S // m, d) and full.open_kv.shape == (S % m, 2 * d)
    # the next window's entry from the kept state equals pooling the longer sequence
    x2 = torch.cat([x, torch.randn(1, D)])
    longer = compressor.pool(x2, w, m, True, 0, no_rope, 1e-6)
    tail_kv = torch.cat([full.open_kv, torch.nn.functional.linear(x2[-1:], w["wkv.weight"])])
    tail_gate = torch.cat([full.open_gate, torch.nn.functional.linear(x2[-1:], w["wgate.weight"])])
    slots_kv = torch.cat([full.overlap_kv, tail_kv[:, d:]])
    slots_gate = torch.cat([full.overlap_gate, tail_gate[:, d:] + w["ape"][:, d:]])
    pooled = (slots_kv * slots_gate.softmax(dim=0)).sum(dim=0)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean() + 1e-6)
    assert torch.allclose(normed, longer.entries[-1], atol=1e-6)
