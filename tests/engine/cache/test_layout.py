"""State ledger geometry: ring sizes (RuntimeLayout), the StateBlock layout and its start-up check."""

import pytest

from kvmesh import envs
from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.state_layout import LayoutBuilder, is_dropped_swa_layer
from services.engine.cache.state_pool import StatePool
from services.engine.config import TINY, V41_FLASH, EngineConfig, small_test_config


@pytest.fixture
def clean_rings(monkeypatch):
    for var in envs.ENGINE_VARS.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def layout(cfg=V41_FLASH, **ecfg) -> RuntimeLayout:
    return RuntimeLayout.build(cfg, EngineConfig(**ecfg))


def test_v41_flash_sizes(clean_rings):
    assert V41_FLASH.n_layers == 40 and V41_FLASH.n_encoder_layers == 20
    assert V41_FLASH.layers[:4] == ("swa", "swa", "csa", "hca")
    assert V41_FLASH.swa_bytes_per_token == 528
    assert layout().inference_ring == 134
    sb = layout().block
    assert sb.n_stored_layers == 20
    assert sb.state_size_to_disk == 20 * 134 * 528 == 1_415_040


def test_kvstore_ring_is_396_with_extra_state_and_truncation(clean_rings):
    lay = layout(extra_state=True, truncation="compact", keep_tokens=134)
    assert lay.kvstore_ring == 134 + 128 + 134 == 396
    sb = lay.block
    assert sb.swa_ring == 396
    # what is persisted is still the inference window
    assert sb.state_size_to_disk == 1_415_040


def test_kvstore_ring_without_truncation_or_extra_state(clean_rings):
    assert layout().kvstore_ring == 134                                  # extra-state off
    assert layout(extra_state=True).kvstore_ring == 134 + 128            # truncation off: no YOCO keep


def test_ring_sizes_are_fixed_once_built(clean_rings):
    """A built layout is the process's answer: a later environment change reaches only
    layouts built after it (the engine builds one, at start-up)."""
    lay = RuntimeLayout.build(V41_FLASH, EngineConfig.from_flags())
    assert lay.inference_ring == 134
    assert lay.compress_ring(4) == 10 and lay.compress_ring(128) == 134
    clean_rings.setenv("KVMESH_MAX_BACKTRACKING_TOKENS", "2")
    assert lay.inference_ring == 134              # frozen: never recomputed behind its back
    lay = RuntimeLayout.build(V41_FLASH, EngineConfig.from_flags())
    assert lay.inference_ring == 130
    assert lay.compress_ring(4) == 6


def test_v41_flash_region_offsets(clean_rings):
    sb = layout().block
    regions = sb.regions()
    swa = [r for r in regions if r.name == "swa"]
    assert [r.layer for r in swa] == list(range(40))
    ring_bytes = 134 * 528
    assert all(r.nbytes == ring_bytes for r in swa)
    assert swa[0].offset == 0 and swa[19].offset == 19 * ring_bytes
    # dropped region starts exactly where the persisted prefix ends
    assert swa[20].offset == sb.state_size_to_disk == 1_415_040
    comp = [r for r in regions if r.name in ("cmp", "idx")]
    assert comp[0].offset == 40 * ring_bytes == 2_830_080
    # 19 csa layers (cmp + idx rings of 10 tokens) and 19 hca layers (134 tokens), fp32
    csa = 10 * 2 * 512 * 4 + 10 * 2 * 128 * 4
    hca = 134 * 2 * 512 * 4
    assert sb.compression_bytes == 19 * csa + 19 * hca == 19 * 51_200 + 19 * 548_864
    assert sb.slot_bytes == 2_830_080 + 11_401_216 == regions[-1].offset + regions[-1].nbytes


def test_dropped_layers_come_from_the_config_only(clean_rings):
    assert [is_dropped_swa_layer(TINY, i) for i in range(8)] == [False] * 4 + [True] * 4
    clean_rings.setenv("KVMESH_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    clean_rings.setenv("KVMESH_YOCO_PREFILL_KEEP_TOKENS", "134")
    assert [is_dropped_swa_layer(TINY, i) for i in range(8)] == [False] * 4 + [True] * 4
    # nor does truncation change the stored layers of a layout
    on = RuntimeLayout.build(TINY, EngineConfig.from_flags()).block
    off = layout(TINY).block
    assert on.n_stored_layers == off.n_stored_layers == 4 and on.stored_bytes == off.stored_bytes


def test_layout_drift_fails_loudly(clean_rings):
    sb = layout(TINY).block
    b = LayoutBuilder(sb)
    b.add("swa", 0, (134, 528), "uint8")
    with pytest.raises(AssertionError, match="state layout drift"):
        b.finalize()


def test_pool_views_cover_the_slot_bytes(clean_rings):
    cfg = small_test_config()
    pool = StatePool(RuntimeLayout.build(cfg, EngineConfig(num_slots=3)))
    sb = pool.block
    assert pool.data.shape == (3, sb.slot_bytes)
    # writing through a view lands at the documented byte offset of that slot
    pool.swa[1][2, 5, 7] = 99
    r = next(r for r in sb.regions() if r.name == "swa" and r.layer == 1)
    assert pool.data[2, r.offset + 5 * 528 + 7] == 99
    pool.cmp[2][1, 3, 1, 4] = 1.5
    c = next(r for r in sb.regions() if r.name == "cmp" and r.layer == 2)
    raw = pool.data[1, c.offset:c.offset + c.nbytes].view(dtype=__import__("torch").float32)
    assert raw[(3 * 2 + 1) * 512 + 4] == 1.5
    # the persisted prefix is exactly the encoder rings
    assert sb.state_size_to_disk == 4 * (16 + 6) * 528


@pytest.mark.parametrize("cfg,without", [
    # tiny: 4 x 134 x 528 encoder + 4 x 134 x 528 decoder SWA, compression 3 csa (10 rows,
    # 2 x 512 + 2 x 32 fp32) + 3 hca (134 rows, 2 x 512 fp32)
    (TINY, 8 * 134 * 528 + 3 * (10 * 2 * 512 * 4 + 10 * 2 * 32 * 4) + 3 * 134 * 2 * 512 * 4),
    (V41_FLASH, 2_830_080 + 11_401_216),
])
def test_mtp_ring_adds_one_inference_ring_after_the_rest(clean_rings, cfg, without):
    """--speculative mtp:K adds W + B rows of 528 B (70,752 B) at the end of the slot; the
    persisted prefix, the replica and the regions before it do not move."""
    off, on = layout(cfg).block, layout(cfg, speculative="mtp:3").block
    assert off.slot_bytes == without and off.mtp_bytes == 0
    assert on.mtp_bytes == 134 * 528 == 70_752
    assert on.slot_bytes == without + 70_752
    assert on.state_size_to_disk == off.state_size_to_disk == 4 * 134 * 528 * (
        1 if cfg is TINY else 5)                      # 283,008 / 1,415,040
    regions_on, regions_off = on.regions(), off.regions()       # finalize() agreed
    assert regions_on[:-1] == regions_off
    mtp = regions_on[-1]
    assert (mtp.name, mtp.offset, mtp.nbytes, mtp.shape) == ("mtp", without, 70_752, (134, 528))
    assert layout(cfg, speculative="ngram:4").block.slot_bytes == without
    # a prefill engine's 396-row rings leave the MTP ring at W + B
    pe = layout(cfg, speculative="mtp:3", extra_state=True, truncation="compact",
                keep_tokens=134).block
    assert pe.mtp_bytes == 70_752 and pe.regions()[-1].shape == (134, 528)


def test_mtp_layout_drift_fails_loudly(clean_rings):
    sb = layout(TINY, speculative="mtp:2").block
    b = LayoutBuilder(sb)
    for r in sb.regions()[:-1]:
        b.add(r.name, r.layer, r.shape, r.dtype)
    with pytest.raises(AssertionError, match="state layout drift"):
        b.finalize()                                  # the MTP ring is missing
