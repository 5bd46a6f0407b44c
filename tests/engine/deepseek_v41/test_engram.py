"""DeepSeek V4.1's Engram layers (v41_engram.py): the hash layout against the release's
published table sizes and an independent per-token computation, the tokenizer folding, the
gated write against its formula, the model with Engram (reference forward, chunked cache,
truncation) and checkpoints that carry it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch

from kvmesh.services.engine.model.deepseek_v4 import v41_engram
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.score import score
from kvmesh.services.engine.model.deepseek_v4.v41_cached import SequenceState, extend
from kvmesh.services.engine.model.deepseek_v4.v41_config import (
    read_v41_config,
    v41_config_from_dict,
)
from kvmesh.services.engine.model.deepseek_v4.v41_engram import EngramHasher, bucket_primes
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v41 import tiny

FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4.1-flash.json"
NAME = "flash_like"          # KV sources 1 and 3; 3 is the first decoder layer
ENGRAM = tiny.engram_fields([1, 3])


def test_the_hash_layout_gives_flash_its_published_table_sizes():
    """384,006,168 and 384,016,682 rows are V4.1-Flash's tables as released: the sums of
    the primes this layout draws from engram_vocab_size = 16,000,000 (4-grams, 8 heads)."""
    cfg = read_v41_config(FLASH)
    assert cfg.engram.rows == (384_006_168, 384_016_682)
    drawn = [p for layer in bucket_primes(cfg.engram) for size in layer for p in size]
    assert len(drawn) == 2 * 3 * 8 and drawn == sorted(set(drawn)) and drawn[0] >= 16_000_000
    assert all(sympy.isprime(p) for p in drawn)
    assert sympy.nextprime(drawn[-1] - 1) == drawn[-1]     # consecutive: none skipped
    assert all(sympy.nextprime(a) == b for a, b in zip(drawn, drawn[1:], strict=False))
    raw = json.loads(FLASH.read_text())
    raw["text_config"]["engram_num_embeddings"] = [384_006_168, 384_016_683]
    with pytest.raises(CheckpointError, match=r"engram_num_embeddings \[384006168, 384016683\]"
                       r".*gives tables of \[384006168, 384016682\] rows"):
        v41_config_from_dict(raw)


def test_the_token_map_folds_case_accents_width_and_whitespace():
    m = tiny.token_map().tolist()
    word = {w: i for i, w in enumerate(tiny.WORDS)}
    same = [("w3", "W3"), ("w12", " w12 "), ("cafe", "café"), ("cafe", "CAFÉ"),
            ("naive", "naïve"), (" ", "\t"), (" ", "\n\n"), ("full", "ｆｕｌｌ")]
    for a, b in same:
        assert m[word[a]] == m[word[b]], (a, b)
    assert m[word["w3"]] != m[word["w4"]] and m[word[" "]] != m[word["w0"]]
    assert len(set(m)) == 74 == ENGRAM["engram_compressed_vocab_size"]   # 70 words + 4 folded
    assert m[:70] == list(range(70))                         # new ids in token-id order


def _rows_by_hand(spec, token_map, ids: list[int]) -> list[list[list[int]]]:
    """[position][layer][column] with Python integers, one token at a time."""
    import numpy as np
    primes = bucket_primes(spec)
    out = []
    for j in range(len(ids)):
        per_layer = []
        for li, layer in enumerate(spec.layers):
            bound = (2**63 - 1) // spec.compressed_vocab // 2
            mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer).integers(
                0, bound, size=spec.max_ngram, dtype=np.int64)]
            c = [token_map[min(ids[j - s], len(token_map) - 1)] if j - s >= 0
                 else token_map[spec.pad_id] for s in range(spec.max_ngram)]
            flat = [p for size in primes[li] for p in size]
            h, cols = c[0] * mult[0], []
            for g in range(1, spec.max_ngram):
                h ^= c[g] * mult[g]
                for k, p in enumerate(primes[li][g - 1]):
                    at = (g - 1) * spec.heads + k
                    cols.append(h % p + sum(flat[:at]))
            per_layer.append(cols)
        out.append(per_layer)
    return out


def test_hash_rows_equal_a_token_by_token_computation_and_chunks_agree():
    cfg = tiny.config(NAME, **ENGRAM)
    token_map = tiny.token_map()
    hasher = EngramHasher(cfg.engram, token_map)
    ids = tiny.prompt(NAME)                          # ids 95..99 lie past the tokenizer
    assert (ids >= len(tiny.WORDS)).any()
    whole = hasher.rows(ids, [])
    assert whole.tolist() == _rows_by_hand(cfg.engram, token_map.tolist(), ids.tolist())
    assert int(whole.max()) < max(cfg.engram.rows)
    for cut in (1, 2, 17):
        assert torch.equal(hasher.rows(ids[cut:], ids[:cut]), whole[cut:])
    # a token reaches its own rows and the next n - 1 tokens' only
    other = ids.clone()
    other[10] = (other[10] + 1) % 70
    moved = (hasher.rows(other, []) != whole).any(-1).any(-1).nonzero().flatten().tolist()
    assert moved == [10, 11, 12]


def test_the_gated_write_is_the_formula():
    g = torch.Generator().manual_seed(3)
    S, n, D, cols, hd = 3, 2, 8, 4, 4
    w = {"embed.weight": torch.randn(50, hd, generator=g, dtype=torch.float64),
         "wkv.weight": torch.randn((n + 1) * D, cols * hd, generator=g, dtype=torch.float64) * 0.3,
         "q_weight": torch.randn(n, D, generator=g, dtype=torch.float64),
         "k_weight": torch.randn(n, D, generator=g, dtype=torch.float64)}
    streams = torch.randn(S, n, D, generator=g, dtype=torch.float64)
    rows = torch.randint(0, 50, (S, cols), generator=g)
    got = v41_engram.write(streams, rows, w, 1e-6, torch.float64)
    for t in range(S):
        kv = w["wkv.weight"] @ w["embed.weight"][rows[t]].flatten()
        value = kv[n * D:]
        for j in range(n):
            h, key = streams[t, j].tolist(), kv[j * D:(j + 1) * D].tolist()
            rms_h = math.sqrt(sum(x * x for x in h) / D + 1e-6)
            rms_k = math.sqrt(sum(x * x for x in key) / D + 1e-6)
            dot = sum(h[i] * float(w["q_weight"][j, i] * w["k_weight"][j, i]) * key[i]
                      for i in range(D)) / rms_h / rms_k / math.sqrt(D)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            want = torch.tensor(h, dtype=torch.float64) + gate * value
            assert (got[t, j] - want).abs().max() <= 1e-12


@pytest.fixture(scope="module")
def model():
    cfg = tiny.config(NAME, **ENGRAM)
    return V41Model(cfg, tiny.weights(cfg, 0, torch.float64), torch.float64)


def test_engram_moves_the_logits_and_a_zero_value_projection_is_no_engram(model):
    ids = tiny.prompt(NAME)
    plain_cfg = replace(model.cfg, engram=None)
    plain_w = {k: v for k, v in model.weights.items()
               if ".engram." not in k and k != v41_engram.TOKEN_MAP}
    plain = V41Model(plain_cfg, plain_w, torch.float64).logits(ids)
    assert (model.logits(ids) - plain).abs().max() > 1e-2
    silent = dict(model.weights)
    for layer in model.cfg.engram.layers:
        silent[f"layers.{layer}.engram.wkv.weight"] = torch.zeros_like(
            silent[f"layers.{layer}.engram.wkv.weight"])
    assert torch.equal(V41Model(model.cfg, silent, torch.float64).logits(ids), plain)


@pytest.mark.parametrize("chunks", [[48], [1] * 48, [5, 1, 1, 20, 3, 18], [2, 30, 16]])
def test_the_cached_forward_in_chunks_equals_the_whole_sequence(model, chunks):
    ids = tiny.prompt(NAME)
    want = model.logits(ids)
    state, out, at = SequenceState(), [], 0
    for size in chunks:
        out.append(extend(model, state, ids[at:at + size]))
        at += size
    assert (torch.cat(out) - want).abs().max() <= 1e-9


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_truncation_with_an_engram_decoder_layer_equals_the_reference_cut(model, mode):
    """Layer 3 is both the first decoder layer and an Engram layer: its rows before the cut
    still feed its compressor, and only the kept rows go on."""
    ids, keep = tiny.prompt(NAME), 20
    want = model.logits(ids, keep=keep)
    state, out = SequenceState(), []
    for a, b in ((0, 25), (25, 40), (40, 48)):
        out.append(extend(model, state, ids[a:b], decoder_from=48 - keep, mode=mode))
    got = torch.cat(out)
    if mode == "mask":
        got = got[-keep:]
    assert (got - want).abs().max() <= 1e-9


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engram")
    cfg, meant = tiny.save_release(NAME, directory, **ENGRAM)
    return directory, cfg, meant


def test_a_release_with_engram_loads_its_fp8_tables_and_scores(release):
    directory, cfg, meant = release
    _, w = load_v41_checkpoint(directory, torch.float64)
    table = "layers.1.engram.embed.weight"
    # kept as stored (FP8, a scale exponent per 32), dequantized row by row when read
    assert w[table].dtype == torch.float8_e4m3fn and w["layers.1.engram.embed.scale"].shape == (
        cfg.engram.rows[0], cfg.engram.head_dim // 32)
    every = torch.arange(cfg.engram.rows[0]).view(-1, 1)
    got = v41_engram.lookup({k[len("layers.1.engram."):]: v for k, v in w.items()
                             if k.startswith("layers.1.engram.")}, every)[:, 0]
    assert torch.equal(got.double(), meant[table])
    assert torch.equal(w[v41_engram.TOKEN_MAP], tiny.token_map())
    ids = tiny.prompt(NAME)[:24].tolist()
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model",
                          str(directory), "--ids", ",".join(map(str, ids)), "--dtype", "float64"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    want = score(V41Model(cfg, meant, torch.float64), ids)
    printed = json.loads(run.stdout)
    assert printed["argmax"] == want["argmax"]
    assert (torch.tensor(printed["logprobs"][1:]) - torch.tensor(want["logprobs"][1:])).abs().max() <= 1e-9


def _copy(directory, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    return copy


def test_a_release_without_its_tokenizer_is_refused_naming_the_file(release, tmp_path):
    copy = _copy(release[0], tmp_path)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing; the Engram layers \[1, 3\]"):
        load_v41_checkpoint(copy)


def test_a_tokenizer_that_folds_differently_is_refused(release, tmp_path):
    copy = _copy(release[0], tmp_path)
    raw = json.loads((copy / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] = 75
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"normalizes to 74 distinct tokens, but "
                       r"engram_compressed_vocab_size in config\.json is 75"):
        load_v41_checkpoint(copy)


def test_a_missing_table_is_named_with_its_layer(release, tmp_path):
    from tests.engine.deepseek_v41.test_checkpoint import _without
    broken = _without(release[0], tmp_path, "layers.3.engram.wkv.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.3\.engram\.wkv\.weight .*"
                       r"layer 3's Engram module"):
        load_v41_checkpoint(broken)
