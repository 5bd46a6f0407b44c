"""`kvmesh engine layout` for DeepSeek-V4-Flash's published config: the design's byte counts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from kvmesh.services.engine.model.deepseek_v4 import layout
from kvmesh.services.engine.model.deepseek_v4.config import read_config

FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4-flash.json"


def test_flash_state_slot_and_blocks():
    rep = layout.report(read_config(FLASH))
    s, b = rep["state_slot"], rep["block"]
    assert (s["swa_row_bytes"], s["swa_ring_rows"]) == (528, 134)
    assert s["swa_bytes"] == s["state_size_to_disk"] == 43 * 134 * 528 == 3_042_336
    tails = s["compression_tail_bytes_per_layer"]
    # CSA: (2 x 4 + 6) rows x (kv, gate) x 2 x 512 fp32; indexer at 128; HCA: (128 + 6) x 2 x 512
    assert tails["csa"] == {"compressor": 14 * 2 * 1024 * 4, "indexer": 14 * 2 * 256 * 4}
    assert tails["hca"] == {"compressor": 134 * 2 * 512 * 4}
    assert s["compression_bytes"] == 21 * (114_688 + 28_672) + 20 * 548_864
    assert s["bytes"] == 3_042_336 + 13_987_840
    assert s["mtp_ring_bytes"] == 134 * 528
    assert s["snapshot_bytes"] == 3_042_336 + 21 * 4 * 2 * (512 + 128) * 4     # + 430,080 B
    assert b["bytes_per_token_per_layer"] == {"sliding": 0, "csa": (512 + 128) * 4 / 4,
                                             "hca": 512 * 4 / 128}
    assert b["bytes"] == 21 * 32 * 640 * 4 + 20 * 2048 == 1_761_280
    assert b["blocks_per_gib"] == (1 << 30) // 1_761_280


def test_extra_state_grows_the_ring_to_396_but_not_what_is_persisted():
    rep = layout.report(read_config(FLASH), extra_state=True)
    s = rep["state_slot"]
    assert s["swa_ring_rows"] == 396 and s["swa_bytes_per_layer"] == 396 * 528
    assert s["state_size_to_disk"] == 43 * 134 * 528


def test_cli_prints_the_same_numbers():
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "engine", "layout", "--config",
                          str(FLASH), "--json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == json.loads(json.dumps(layout.report(read_config(FLASH))))
    table = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "engine", "layout", "--config",
                            str(FLASH)], capture_output=True, text=True, timeout=60).stdout
    assert "134 rows x 528 B (mxfp8) x 43 layers = 3,042,336 B" in table


def test_cli_prints_what_one_rank_of_a_split_flash_engine_holds(capsys):
    """DeepSeek-V4-Flash split 8 ways (tensor, then expert parallel), float32 weights: a rank
    holds the replicated tensors whole and an eighth of the split ones (docs/design.md §15);
    every rank's ledgers are the unsplit engine's. Sums from the tensor shapes, here."""
    from kvmesh.launch.cli import main
    from kvmesh.services.engine.model.deepseek_v4 import names

    cfg = read_config(FLASH)
    shapes = {**names.expected_shapes(cfg), **names.mtp_shapes(cfg)}
    size = {n: (8 if n.endswith("tid2eid") else 4) * math.prod(s) for n, s in shapes.items()}
    by_tp = ("attn.wq_b.weight", "attn.attn_sink", "attn.wo_a.weight", "attn.wo_b.weight")
    experts = sum(v for n, v in size.items() if n.startswith("layers.") and ".experts.w" in n)
    shared = sum(v for n, v in size.items() if n.startswith("layers.") and "shared_experts" in n)
    heads = sum(v for n, v in size.items() if n.startswith("layers.") and n.endswith(by_tp))
    whole = sum(size.values())
    assert whole > 1_100_000_000_000                 # ~284 B parameters, float32
    for flag, split in (("--tensor-parallel", experts + shared + heads + size["head.weight"]),
                        ("--expert-parallel", experts + shared)):
        assert main(["engine", "layout", "--config", str(FLASH), flag, "8", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        ranks = report.pop("ranks")
        assert ranks["weight_bytes_whole"] == whole and ranks["ranks"] == 8
        assert ranks["weight_bytes_per_rank"] == whole - split * 7 // 8, flag
        assert report == json.loads(json.dumps(layout.report(read_config(FLASH))))
    assert main(["engine", "layout", "--config", str(FLASH), "--expert-parallel", "3"]) == 2
    assert "n_routed_experts (256) is not divisible by 3" in capsys.readouterr().err
