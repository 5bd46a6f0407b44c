"""Each piece against the transformers module it re-implements, on the same weights and the
same inputs (captured with forward hooks during transformers' own float64 forward), so a
parity failure names its piece: hyper-connections, attention, compressor, indexer, MoE,
hc_head."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import compressor, hyper
from kvmesh.services.engine.model.deepseek_v4.attention import attention
from kvmesh.services.engine.model.deepseek_v4.config import CSA, SLIDING
from kvmesh.services.engine.model.deepseek_v4.moe import moe
from kvmesh.services.engine.model.deepseek_v4.score import load_model
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


@pytest.mark.parametrize("overlapping", [True, False])
def test_compressor_continues_from_its_kept_state(overlapping):
    """What a cache keeps beside the entries (the open window's raw projections and, for CSA,
    the last closed window's A series) is all the next tokens need: pooling 11 tokens and then
    the rest from that state gives what pooling them all at once gives."""
    torch.manual_seed(0)
    d, D, m, S = 8, 16, 4, 23
    width = 2 * d if overlapping else d
    w = {"wkv.weight": torch.randn(width, D, dtype=torch.float64),
         "wgate.weight": torch.randn(width, D, dtype=torch.float64),
         "ape": torch.randn(m, width, dtype=torch.float64),
         "norm.weight": torch.ones(d, dtype=torch.float64)}
    x = torch.randn(S, D, dtype=torch.float64)
    rope = lambda p: (torch.cos(p.double().view(-1, 1)), torch.sin(p.double().view(-1, 1)))  # noqa: E731
    first = compressor.pool(x[:11], w, m, overlapping, rope, 1e-6)
    assert first.entries.shape == (11 // m, d) and first.open_kv.shape == (11 % m, width)
    assert (first.overlap_kv is not None) == overlapping
    for split in ([11, 12, 23], [11, 23]):
        state = first
        for a, b in zip(split, split[1:], strict=False):
            state = compressor.pool(x[a:b], w, m, overlapping, rope, 1e-6, state)
        whole = compressor.pool(x, w, m, overlapping, rope, 1e-6)
        assert torch.allclose(state.entries, whole.entries, rtol=0, atol=1e-12)
        # the same rows projected in a shorter batch: equal up to the BLAS's blocking
        assert torch.allclose(state.open_kv, whole.open_kv, rtol=0, atol=1e-12)
