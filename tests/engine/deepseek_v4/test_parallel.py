"""DeepSeek V4 split over ranks (model/deepseek_v4/parallel.py) computes what one process does:
gloo process groups on the CPU, tp x ep = 2 x 1, 1 x 2 and 2 x 2, float64. Every rank's
logits of a whole prompt (the full forward) and of a prompt prefilled in chunks then decoded
greedily one token at a time (the cached path, `cached.extend`) match the unsplit model's to
1e-10, and the greedy tokens are the same."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvmesh.services.engine.model.deepseek_v4 import names
from kvmesh.services.engine.model.deepseek_v4.cached import SequenceCache, extend
from kvmesh.services.engine.model.deepseek_v4.config import config_from_dict
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.parallel import (
    Groups,
    ParallelV4Model,
    Split,
    shard_weights,
)

CONFIG = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2,
              o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, index_n_heads=2, index_head_dim=16, index_topk=64,
              sliding_window=8, hc_mult=2,
              layer_types=["sliding_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention", "compressed_sparse_attention"],
              compress_rates={"compressed_sparse_attention": 4,
                              "heavily_compressed_attention": 16},
              mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
PROMPT, CHUNK, DECODE = 40, 16, 6
TOL = 1e-10


def tiny(mtp: bool = False, **overrides):
    """The config (CONFIG with `overrides`) and seeded random weights (every rank builds the
    same); mtp: an MTP module's too."""
    cfg = config_from_dict({**CONFIG, **overrides})
    g = torch.Generator().manual_seed(0)
    weights = {}
    shapes = {**names.expected_shapes(cfg), **(names.mtp_shapes(cfg) if mtp else {})}
    for name, shape in shapes.items():
        if name.endswith("tid2eid"):
            weights[name] = torch.randint(0, cfg.n_experts, shape, generator=g)
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            weights[name] = torch.randn(shape, generator=g, dtype=torch.float64) * \
                (0.15 if len(shape) < 2 else 0.1)
    return cfg, weights


def run(model: V4Model) -> dict:
    """The whole prompt's logits, and the cached path: the prompt in chunks, then greedy
    decode steps; every step's logits and the tokens."""
    ids = torch.randint(0, 100, (PROMPT,), generator=torch.Generator().manual_seed(1))
    full = model.logits(ids)
    cache, steps = SequenceCache(), []
    for start in range(0, PROMPT, CHUNK):
        steps.append(extend(model, cache, ids[start:start + CHUNK])[-1])
    tokens = []
    for _ in range(DECODE):
        tokens.append(int(steps[-1].argmax()))
        steps.append(extend(model, cache, [tokens[-1]])[-1])
    return {"full": full, "steps": torch.stack(steps), "tokens": tokens}


def rank_main(rank: int, tp: int, ep: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp * ep)
    try:
        cfg, weights = tiny()
        split = Split(tp, ep, rank)
        model = ParallelV4Model(cfg, shard_weights(cfg, weights, split), torch.float64, split,
                                Groups(split))
        torch.save(run(model), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def unsplit():
    cfg, weights = tiny()
    return run(V4Model(cfg, weights, torch.float64))


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)])
def test_a_split_model_computes_what_one_process_does(tmp_path, unsplit, tp, ep):
    from kvmesh.launch.backing.proc import free_port

    mp.start_processes(rank_main, args=(tp, ep, free_port(), str(tmp_path)), nprocs=tp * ep,
                       start_method="spawn")
    for rank in range(tp * ep):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tokens"] == unsplit["tokens"], rank
        for key in ("full", "steps"):
            err = (got[key] - unsplit[key]).abs().max().item()
            assert err <= TOL, (rank, key, err)
        # the numbers are not the unsplit ones by accident of a share left out
        assert unsplit["full"].abs().max() > 0.1


def test_a_split_the_config_does_not_divide_is_refused_naming_the_field():
    cfg, _ = tiny()
    with pytest.raises(ValueError, match="n_routed_experts \\(4\\) is not divisible by 3"):
        Split(1, 3, 0).check(cfg)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by 8"):
        Split(8, 1, 0).check(cfg)


def test_each_rank_holds_its_share_of_the_split_tensors():
    cfg, weights = tiny()
    split = Split(2, 2, 3)                       # e = 1, t = 1
    mine = shard_weights(cfg, weights, split)
    w13, full13 = mine["layers.1.ffn.experts.w13"], weights["layers.1.ffn.experts.w13"]
    assert w13.shape == (2, 32, 64)              # experts 2, 3; gate and up rows 16..31 each
    assert torch.equal(w13[:, :16], full13[2:, 16:32]) and torch.equal(w13[:, 16:], full13[2:, 48:])
    assert torch.equal(mine["layers.1.ffn.experts.w2"], weights["layers.1.ffn.experts.w2"][2:, :, 16:])
    assert torch.equal(mine["layers.0.attn.wq_b.weight"], weights["layers.0.attn.wq_b.weight"][64:])
    assert torch.equal(mine["layers.0.attn.wo_b.weight"], weights["layers.0.attn.wo_b.weight"][:, 16:])
    assert torch.equal(mine["layers.0.ffn.shared_experts.w1.weight"],
                       weights["layers.0.ffn.shared_experts.w1.weight"][24:])
    assert torch.equal(mine["head.weight"], weights["head.weight"][50:])
    assert mine["layers.0.attn.wkv.weight"] is weights["layers.0.attn.wkv.weight"]


@pytest.mark.parametrize("form", ["stacked", "per_expert_fp8_fp4"])
def test_a_rank_loads_its_share_and_reads_only_its_experts(tmp_path, monkeypatch, form):
    """Stacked: transformers' module names, each layer's experts in one tensor (the rank's
    rows of it are read); per expert: DeepSeek's names, FP8 dense weights and FP4 experts
    (the rank's experts' tensors are read, no other's)."""
    import re

    from kvmesh.services.engine.model.deepseek_v4 import checkpoint
    from tests.engine.deepseek_v4 import tiny as hf_tiny

    model = hf_tiny.hf_model("mixed")
    directory = tmp_path / form
    if form == "stacked":
        hf_tiny.resave(model, directory, "transformers")
    else:
        hf_tiny.resave(model, directory, "deepseek", fp8="ue8m0", fp4_experts=True)
    cfg, whole = checkpoint.load_checkpoint(directory, torch.float64)
    reads: list[tuple[str, range | None]] = []
    read = checkpoint._Reader.read
    monkeypatch.setattr(checkpoint._Reader, "read",
                        lambda self, name, rows=None: reads.append((name, rows)) or read(self, name, rows))
    for rank in range(4):
        split = Split(2, 2, rank)
        reads.clear()
        _, mine = checkpoint.load_checkpoint(directory, torch.float64, split)
        want = shard_weights(cfg, whole, split)
        assert mine.keys() == want.keys()
        for name in want:
            assert torch.equal(mine[name], want[name]), (rank, name)
        held = range(2 * split.e, 2 * split.e + 2)
        expert_reads = 0
        for name, rows in reads:
            if re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.\w+", name):
                assert rows == held, (name, rows)      # a stacked tensor: its rows alone
                expert_reads += 1
            elif m := re.fullmatch(r"layers\.\d+\.ffn\.experts\.(\d+)\..+", name):
                assert int(m[1]) in held, name          # per expert: the rank's alone
                expert_reads += 1
        assert expert_reads >= 2 * 4                   # 4 layers' routed experts were read


def v41_rank_main(rank: int, tp: int, ep: int, port: int, out: str) -> None:
    from kvmesh.services.engine.model.deepseek_v4.parallel import ParallelV41Model
    from tests.engine.deepseek_v41 import tiny as v41_tiny

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp * ep)
    try:
        cfg = v41_tiny.config("flash_like", **v41_tiny.engram_fields([1, 3]))
        split = Split(tp, ep, rank)
        model = ParallelV41Model(cfg, shard_weights(cfg, v41_tiny.weights(cfg), split),
                                 torch.float64, split, Groups(split))
        ids = v41_tiny.prompt("flash_like")
        torch.save({"full": model.logits(ids), "compact": model.logits(ids, keep=12)},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_split_v41_model_computes_what_one_process_does(tmp_path):
    """DeepSeek V4.1 (KV sources, consumers, candidate blocks, Engram layers; decoder-side
    truncation) split 2 x 2: the whole forward and the compact one match the unsplit model's."""
    from kvmesh.launch.backing.proc import free_port
    from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
    from tests.engine.deepseek_v41 import tiny as v41_tiny

    cfg = v41_tiny.config("flash_like", **v41_tiny.engram_fields([1, 3]))
    whole = V41Model(cfg, v41_tiny.weights(cfg), torch.float64)
    ids = v41_tiny.prompt("flash_like")
    want = {"full": whole.logits(ids), "compact": whole.logits(ids, keep=12)}
    mp.start_processes(v41_rank_main, args=(2, 2, free_port(), str(tmp_path)), nprocs=4,
                       start_method="spawn")
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key in want:
            assert (got[key] - want[key]).abs().max().item() <= TOL, (rank, key)
    assert want["full"].abs().max() > 0.1
