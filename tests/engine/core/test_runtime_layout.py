"""Engine flags size the rings: the real `kvmesh engine ...` argv -> EngineConfig ->
RuntimeLayout -> the engine's pools, with no KVMESH_* variable set; the environment
is only a fallback for flags not given; `kvmesh engine layout` prints the same object."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import build_parser
from services.engine.build import MAX_RUNNING, build_core, runtime_layout
from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.state_pool import StatePool
from services.engine.config import V41_FLASH, EngineConfig

ROOT = Path(__file__).resolve().parents[3]

# v41-flash slot regions for each slot ring R: [stored end, dropped SWA end, slot end].
# Stored = 20 encoder rings x R x 528 B; compression state (11,401,216 B) does not depend on R.
V41_REGIONS = {134: (1_415_040, 2_830_080, 14_231_296),
               262: (2_766_720, 5_533_440, 16_934_656),
               396: (4_181_760, 8_363_520, 19_764_736)}


@pytest.fixture
def no_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVMESH_")]:
        monkeypatch.delenv(var)
    return monkeypatch


def engine_args(*flags, command="serve"):
    return build_parser().parse_args(["engine", command, *flags])


def flags_for(truncation: str, extra: bool) -> list[str]:
    # KEEP is given even with truncation off: it must then not count toward the ring
    out = ["--truncation", truncation, "--keep-tokens", "134"]
    return out + (["--extra-state"] if extra else [])


def expected_ring(truncation: str, extra: bool) -> int:
    if not extra:
        return 134
    return 134 + 128 if truncation == "off" else 134 + 128 + 134


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("truncation", ["off", "compact", "mask"])
def test_flags_size_the_engine_rings(no_env, truncation, extra):
    ring = expected_ring(truncation, extra)
    assert ring in (134, 262, 396)
    args = engine_args("--preset", "tiny", "--num-slots", "2", "--num-blocks", "8",
                       *flags_for(truncation, extra))
    core = build_core(args)
    lay = core.layout
    assert lay is core.cache.layout is core.cache.states.layout      # one object, everywhere
    assert lay == runtime_layout(args)[2]                            # what `engine layout` prints
    assert (lay.engine.truncation, lay.engine.extra_state) == (truncation, extra)
    assert lay.inference_ring == 134 and lay.kvstore_ring == ring
    assert core.cache.states.ring == ring
    assert all(t.shape[1:] == (ring, 528) for t in core.cache.states.swa.values())
    assert core.runner.inference_ring == 134
    # what the engine allocated is what the layout says (real tensors, not the formulas)
    assert core.cache.states.data.shape == (2, lay.block.slot_bytes)
    assert core.cache.store.payload_bytes() == lay.block_bytes   # (serialized: + 48 framing)


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("truncation", ["off", "compact", "mask"])
def test_flags_size_the_v41_flash_slot(no_env, truncation, extra):
    ring = expected_ring(truncation, extra)
    _, _, lay = runtime_layout(engine_args("--preset", "v41-flash", "--num-slots", "1",
                                           *flags_for(truncation, extra)))
    pool = StatePool(lay)
    stored_end, swa_end, slot_end = V41_REGIONS[ring]
    regions = lay.block.regions()
    swa = [r for r in regions if r.name == "swa"]
    assert [r.offset for r in swa[:2]] == [0, ring * 528]
    assert swa[20].offset == lay.block.stored_bytes == stored_end == 20 * ring * 528
    assert regions[len(swa)].offset == swa_end
    assert lay.block.slot_bytes == slot_end == pool.data.shape[1]
    assert lay.block.state_size_to_disk == 1_415_040                 # snapshots: inference ring
    assert lay.replica_bytes == 1_415_040
    assert pool.swa[0].shape == (1, ring, 528) and pool.cmp[2].shape == (1, 4 + 6, 2, 512)
    assert pool.cmp[3].shape == (1, 128 + 6, 2, 512) and pool.idx[2].shape == (1, 10, 2, 128)


def test_engine_replica_matches_the_layout(no_env):
    core = build_core(engine_args("--preset", "tiny", "--num-slots", "3", "--num-blocks", "8", "--truncation",
                                  "compact", "--keep-tokens", "134", "--extra-state"))
    assert core.prefix.replica.numel() == 3 * core.layout.replica_bytes


def test_env_is_a_fallback_for_flags_not_given(no_env):
    no_env.setenv("KVMESH_PREFILL_STORE_EXTRA_STATE", "1")
    no_env.setenv("KVMESH_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    no_env.setenv("KVMESH_YOCO_PREFILL_KEEP_TOKENS", "134")

    def ring(*flags):
        return runtime_layout(engine_args("--preset", "v41-flash", *flags))[2].kvstore_ring

    assert ring() == 396                                        # environment only
    assert ring("--no-extra-state") == 134                      # flag beats env
    assert ring("--truncation", "off") == 262
    assert ring("--keep-tokens", "200") == 134 + 128 + 200
    assert ring("--extra-state-size", "64") == 134 + 64 + 134
    no_env.setenv("KVMESH_MAX_BACKTRACKING_TOKENS", "2")
    no_env.setenv("KVMESH_YOCO_PREFILL_KEEP_TOKENS", "130")
    assert ring() == 130 + 128 + 130
    assert ring("--max-backtrack", "6", "--keep-tokens", "134") == 396


def test_issue_case_env_extra_state_with_truncation_flags(no_env):
    """Extra-state from the environment, truncation and KEEP from flags: 396, not 262."""
    no_env.setenv("KVMESH_PREFILL_STORE_EXTRA_STATE", "1")
    args = engine_args("--preset", "v41-flash", "--truncation", "compact", "--keep-tokens", "134")
    assert runtime_layout(args)[2].kvstore_ring == 396


def test_bad_env_value_names_the_variable_unless_the_flag_is_given(no_env):
    no_env.setenv("KVMESH_YOCO_PREFILL_KEEP_TOKENS", "lots")
    with pytest.raises(ValueError, match="KVMESH_YOCO_PREFILL_KEEP_TOKENS='lots'"):
        runtime_layout(engine_args("--truncation", "compact"))
    lay = runtime_layout(engine_args("--truncation", "compact", "--keep-tokens", "134"))[2]
    assert lay.engine.keep_tokens == 134


def test_direct_config_reads_no_environment(no_env):
    no_env.setenv("KVMESH_PREFILL_STORE_EXTRA_STATE", "1")
    no_env.setenv("KVMESH_MAX_BACKTRACKING_TOKENS", "2")
    assert RuntimeLayout.build(V41_FLASH, EngineConfig()).kvstore_ring == 134


def test_memory_budget_fit(no_env):
    lay = runtime_layout(engine_args("--preset", "v41-flash", "--num-slots", "16"))[2]
    per_slot = 14_231_296 + 1_415_040
    # v41-flash block: 19 CSA layers x 32 rows x (512 + 128) fp32 + 19 HCA layers x 1 x 512 fp32
    block = 19 * 32 * 640 * 4 + 19 * 512 * 4
    assert lay.block_bytes == block == 1_595_392
    fit = lay.fit(80 << 30)
    assert fit.slots == 16 and fit.blocks == ((80 << 30) - 16 * per_slot) // block
    assert fit.spare == (80 << 30) - 16 * per_slot - fit.blocks * block
    small = lay.fit(3 * per_slot + 5)
    assert (small.slots, small.blocks, small.max_slots) == (3, 0, 3)


def kvmesh_cli(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def test_layout_command_json_for_v41_flash_prefill_engine():
    out = kvmesh_cli("engine", "layout", "--preset", "v41-flash", "--truncation", "compact",
                     "--keep-tokens", "134", "--extra-state", "--memory", "80GiB", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["rings"]["inference_swa"] == 134
    assert d["rings"]["kvstore_swa"] == d["rings"]["slot_swa"] == 396
    assert d["rings"]["kvstore_swa_terms"] == [134, 128, 134]
    assert d["rings"]["compression"] == {"csa": 10, "hca": 134}
    assert d["slot"]["state_size_to_disk"] == 1_415_040
    stored_end, swa_end, slot_end = V41_REGIONS[396]
    assert [(g["name"], g["offset"], g["offset"] + g["bytes"]) for g in d["slot"]["regions"]] == [
        ("encoder_swa", 0, stored_end), ("decoder_swa", stored_end, swa_end),
        ("compression", swa_end, slot_end)]
    assert d["slot"]["bytes"] == slot_end
    slots = MAX_RUNNING                   # engine serve's default --num-slots
    assert d["memory"]["budget"] == 80 << 30 and d["memory"]["slots"] == slots
    assert d["memory"]["blocks"] == ((80 << 30) - slots * (slot_end + 1_415_040)) // 1_595_392


def test_layout_command_table_and_errors():
    out = kvmesh_cli("engine", "layout", "--preset", "v41-flash")
    assert out.returncode == 0, out.stderr
    assert "134" in out.stdout and "1,415,040" in out.stdout and "14,231,296" in out.stdout
    bad = kvmesh_cli("engine", "layout", "--preset", "tiny", "--truncation", "compact")
    assert bad.returncode == 2 and "needs KEEP given explicitly" in bad.stderr
    bad = kvmesh_cli("engine", "layout", "--preset", "tiny", "--memory", "lots")
    assert bad.returncode == 2 and "memory budget 'lots'" in bad.stderr
