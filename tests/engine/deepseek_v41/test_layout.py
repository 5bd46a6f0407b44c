"""`kvmesh engine layout` for DeepSeek-V4.1-Flash's published config: the design's byte counts
(134-row rings of 528 B, 396 with --extra-state, a 1,415,040 B snapshot of the 20 encoder
rings) and the blocks of the four KV sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvmesh.services.engine.model.deepseek_v4 import v41_layout
from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config

FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4.1-flash.json"


def test_the_flash_slot_has_the_designs_numbers():
    cfg = read_v41_config(FLASH)
    rep = v41_layout.report(cfg)
    s, b, m = rep["state_slot"], rep["block"], rep["model"]
    assert (s["swa_ring_rows"], s["swa_row_bytes"]) == (134, 528)
    assert (m["encoder_layers"], m["decoder_layers"]) == (20, 20)
    assert s["state_size_to_disk"] == s["stored_swa_bytes"] == 20 * 134 * 528 == 1_415_040
    assert s["dropped_swa_bytes"] == 20 * 134 * 528
    # ratio-2 sources keep (2 + 6) rows of kv and gate, fp32; the ratio-1 source keeps nothing
    assert s["compression_tail_bytes_per_source"] == {2: 32_768, 8: 32_768, 14: 32_768, 20: 0}
    assert s["bytes"] == 1_415_040 * 2 + 3 * 32_768
    # a block: 64 entries + keys per ratio-2 source, 128 for the ratio-1 source, fp32
    assert b["bytes_per_source"] == {2: 64 * 640 * 4, 8: 64 * 640 * 4, 14: 64 * 640 * 4,
                                     20: 128 * 640 * 4}
    assert b["bytes"] == 819_200
    # Engram's tables are weights (FP8 rows of 256 + a scale per 32); per sequence it keeps
    # nothing but its last 3 tokens, which the engine has anyway
    assert m["engram"] == {"layers": [1, 14], "table_rows": [384_006_168, 384_016_682],
                           "head_dim": 256, "table_bytes_fp8": 768_022_850 * 264,
                           "tokens_kept": 3}


def test_extra_state_rings_have_396_rows_and_the_snapshot_stays_134():
    rep = v41_layout.report(read_v41_config(FLASH), extra_state=True)
    assert rep["state_slot"]["swa_ring_rows"] == 396
    assert rep["state_slot"]["stored_swa_bytes"] == 20 * 396 * 528
    assert rep["state_slot"]["snapshot_bytes"] == 1_415_040


def test_the_cli_prints_this_report():
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "engine", "layout", "--config",
                          str(FLASH), "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    want = v41_layout.report(read_v41_config(FLASH))
    assert json.loads(run.stdout) == json.loads(json.dumps(want))
    table = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "engine", "layout", "--config",
                            str(FLASH)], capture_output=True, text=True, timeout=120)
    assert "20 encoder rings = 1,415,040 B" in table.stdout
    assert "Engram layers [1, 14]: tables of [384006168, 384016682] rows x 256" in table.stdout
