"""DeepSeek V4.1's configuration (`model_type: deepseek_v41`), read from `config.json`.

V4.1 keeps V4's attention, hyper-connections and MoE, and shares the compressed cache across
layers. Per layer, `compress_ratios[l]` says how many tokens one compressed entry of the cache
that layer *reads* covers (0: the layer reads none, window only); it does not say the layer
compresses. Only the `kv_source_layer_ids` own a compressor; every later compressing layer
reads the most recent source's entries. Likewise only `index_source_layer_ids` run the
indexer (the others reuse the most recent selection), and only index sources that are also KV
sources own index keys. `candidate_source_layer_id` adds a first top-k level: that layer
keeps its best `candidate_topk_blocks` blocks of `candidate_block_size` entries, and later
index sources choose only inside them. On V4.1-Flash (40 layers):

    layers   ratio  entries from  selection from  keys from
    0-1      0      -             -               -
    2-7      2      2             2               2          (8-13 and 14-19 alike)
    20-23    1      20            20              20         20 is also the candidate source
    24-27    1      20            24              20         (28, 32, 36 alike)

The text model sits under `text_config` (the vision tower's config beside it is not read:
kvmesh serves text). Engram layers (`engram_*`) are read into an EngramSpec (v41_engram.py);
DSpark draft layers are not read.
`"kvmesh": {"mtp_layers": 1}` is kvmesh's own field: the checkpoint carries a V4-style MTP module
under `kvmesh.mtp.0.` (v41_mtp.py), which `--speculative mtp:K` drafts with.
Every problem is a `CheckpointError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.checkpoint_dir import V41_MODEL_TYPES
from kvmesh.services.engine.model.deepseek_v4.config import (
    Rope,
    _int,
    _quantization,
    _ropes,
    check_shared_sizes,
    read_json_config,
)
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.v41_engram import EngramSpec, table_rows


@dataclass(frozen=True)
class V41Config:
    vocab_size: int = 129280
    hidden_size: int = 5120
    ratios: tuple[int, ...] = ()           # compress_ratios of the layers (DSpark's dropped)
    kv_sources: tuple[int, ...] = ()
    index_sources: tuple[int, ...] = ()
    candidate_source: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 1
    num_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128
    main_rope: Rope = field(default_factory=lambda: Rope(10000.0, 64))
    compress_rope: Rope = field(default_factory=lambda: Rope(160000.0, 64))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_experts: int = 384
    experts_per_token: int = 6
    moe_inter: int = 2304
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    routed_scale: float = 1.5
    swiglu_limit: float = 10.0
    rms_eps: float = 1e-20
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    max_position: int = 1048576
    quantization: dict | None = None
    engram: EngramSpec | None = None       # the n-gram memory layers (v41_engram.py)
    mtp_layers: int = 0                    # kvmesh's own MTP module (v41_mtp.py): 0 or 1

    def __post_init__(self):
        def bad(msg: str):
            raise CheckpointError(msg)
        n = len(self.ratios)
        if not n:
            bad("num_hidden_layers must be positive")
        for i, r in enumerate(self.ratios):
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                bad(f"compress_ratios[{i}] = {r!r}: expected a non-negative integer")
        for key, ids in (("kv_source_layer_ids", self.kv_sources),
                         ("index_source_layer_ids", self.index_sources)):
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                bad(f"{key} {list(ids)} must be increasing layer ids below {n}")
            for i in ids:
                if not self.ratios[i]:
                    bad(f"{key} names layer {i}, whose compress_ratios entry is 0 (it reads no "
                        "compressed cache)")
        for i in self.kv_sources:
            if i not in self.index_sources:
                bad(f"kv_source_layer_ids names layer {i}, which is not in index_source_layer_ids "
                    "(a KV source owns the index keys of its entries)")
        for layer, r in enumerate(self.ratios):
            if not r:
                continue
            source = self.kv_source_of(layer)
            if source is None:
                bad(f"layer {layer} reads a compressed cache (compress_ratios = {r}) but no "
                    "kv_source_layer_ids entry comes at or before it")
            if self.ratios[source] != r:
                bad(f"layer {layer} has compress_ratios = {r}, its KV source (layer {source}) "
                    f"{self.ratios[source]}: a layer reads its source's entries")
            selector = self.index_source_of(layer)
            if selector is None or selector < source:
                bad(f"layer {layer} reads layer {source}'s entries but no index_source_layer_ids "
                    f"entry comes between them")
        if self.candidate_source is not None:
            c = self.candidate_source
            if c not in self.index_sources:
                bad(f"candidate_source_layer_id {c} is not in index_source_layer_ids")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                bad("candidate_topk_blocks and candidate_block_size must be positive with a "
                    "candidate_source_layer_id")
            for i in self.index_sources:
                if i > c and self.kv_source_of(i) != self.kv_source_of(c):
                    bad(f"index source {i} comes after candidate_source_layer_id {c} but reads "
                        f"layer {self.kv_source_of(i)}'s entries, not layer "
                        f"{self.kv_source_of(c)}'s")
        check_shared_sizes(self)
        if self.window <= 0 or self.index_topk <= 0:
            bad("sliding_window and index_topk must be positive")
        if self.engram is not None:
            _check_engram(self.engram, n)
        if self.mtp_layers not in (0, 1):
            bad(f"kvmesh.mtp_layers = {self.mtp_layers}: expected 0 or 1 (one MTP module, "
                "chained for deeper drafts)")

    @property
    def num_layers(self) -> int:
        return len(self.ratios)

    @property
    def engram_layers(self) -> tuple[int, ...]:
        return self.engram.layers if self.engram is not None else ()

    def ratio(self, layer: int) -> int:
        return self.ratios[layer]

    def rope(self, layer: int) -> Rope:
        return self.compress_rope if self.ratios[layer] else self.main_rope

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressed entries `layer` reads: the last KV source at or before it."""
        return _last_at_or_before(self.kv_sources, layer)

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose selection `layer` attends: the last index source at or before it."""
        return _last_at_or_before(self.index_sources, layer)

    @property
    def decoder_start(self) -> int | None:
        """The first decoder layer: the last KV source (layer 20 of 40 on V4.1-Flash).
        From there on a layer's attention and MoE serve only the rows after it (no later
        layer compresses), so decoder-side truncation runs them on a prompt's last tokens;
        the source's compressor reads the encoder's output and still runs on every token.
        The layers before it are the encoder, whose window rings a snapshot keeps."""
        return self.kv_sources[-1] if self.kv_sources else None

    def uses_candidates(self, layer: int) -> bool:
        """Whether index source `layer` chooses only inside the candidate source's blocks."""
        return self.candidate_source is not None and layer > self.candidate_source


def _last_at_or_before(ids: tuple[int, ...], layer: int) -> int | None:
    earlier = [i for i in ids if i <= layer]
    return earlier[-1] if earlier else None


def read_v41_config(path: str | Path) -> V41Config:
    """`config.json` (or its directory) -> V41Config; a CheckpointError names the file."""
    return read_json_config(path, v41_config_from_dict)


def v41_config_from_dict(raw: dict) -> V41Config:
    outer_type = raw.get("model_type")
    text = dict(raw.get("text_config") or {})
    text.update({k: v for k, v in raw.items() if k not in ("text_config", "vision_config")
                 and k not in text})
    model_type = text.get("model_type", outer_type)
    if model_type not in V41_MODEL_TYPES and outer_type not in V41_MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not DeepSeek V4.1 (expected one of "
                              f"{list(V41_MODEL_TYPES)})")
    if int(text.get("num_key_value_heads", 1)) != 1:
        raise CheckpointError("num_key_value_heads must be 1 (one shared K = V head)")
    if _int(text, "num_hash_layers", 0):
        raise CheckpointError("num_hash_layers must be 0: V4.1 routes every layer by score")
    n = _int(text, "num_hidden_layers", 40)
    ratios = text.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < n:
        raise CheckpointError(f"compress_ratios must list at least num_hidden_layers = {n} "
                              f"entries, got {ratios!r}")
    head_dim = _int(text, "head_dim", 512)
    rope_dim = _int(text, "qk_rope_head_dim", 64)
    main, compress = _ropes(text, rope_dim)
    candidate = text.get("candidate_source_layer_id")
    if candidate is not None and (isinstance(candidate, bool) or not isinstance(candidate, int)):
        raise CheckpointError(f"field 'candidate_source_layer_id' must be an integer, got "
                              f"{candidate!r}")
    eos = text.get("eos_token_id", 1)
    return V41Config(
        vocab_size=_int(text, "vocab_size", 129280), hidden_size=_int(text, "hidden_size", 5120),
        ratios=tuple(ratios[:n]), kv_sources=_ids(text, "kv_source_layer_ids"),
        index_sources=_ids(text, "index_source_layer_ids"),
        candidate_source=None if candidate is None or candidate < 0 else candidate,
        candidate_topk_blocks=_int(text, "candidate_topk_blocks", 0),
        candidate_block_size=_int(text, "candidate_block_size", 1),
        num_heads=_int(text, "num_attention_heads", 64), head_dim=head_dim,
        q_lora_rank=_int(text, "q_lora_rank", 1280), o_groups=_int(text, "o_groups", 8),
        o_lora_rank=_int(text, "o_lora_rank", 1024), window=_int(text, "sliding_window", 128),
        main_rope=main, compress_rope=compress,
        hc_mult=_int(text, "hc_mult", 4), hc_sinkhorn_iters=_int(text, "hc_sinkhorn_iters", 20),
        hc_eps=float(text.get("hc_eps", 1e-6)), index_heads=_int(text, "index_n_heads", 32),
        index_head_dim=_int(text, "index_head_dim", 128), index_topk=_int(text, "index_topk", 512),
        n_experts=_int(text, "n_routed_experts", 384),
        experts_per_token=_int(text, "num_experts_per_tok", 6),
        moe_inter=_int(text, "moe_intermediate_size", 2304),
        scoring_func=str(text.get("scoring_func", "sqrtsoftplus")),
        gate_temp=float(text.get("gate_temp", 1.0)),
        routed_scale=float(text.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(text.get("swiglu_limit", 10.0)),
        rms_eps=float(text.get("rms_norm_eps", 1e-20)),
        bos_token_id=text.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        max_position=_int(text, "max_position_embeddings", 1048576),
        quantization=_quantization(text), engram=_engram(text),
        mtp_layers=_kvmesh_mtp_layers(text))


def _engram(text: dict) -> EngramSpec | None:
    layers = _ids(text, "engram_layer_ids")
    if not layers:
        return None
    rows = _ids(text, "engram_num_embeddings")
    pad = "engram_pad_token_id" if "engram_pad_token_id" in text else "engram_pad_id"
    return EngramSpec(layers=layers, rows=rows, max_ngram=_int(text, "engram_max_ngram_size", 0),
                      heads=_int(text, "engram_n_heads", 0),
                      head_dim=_int(text, "engram_head_dim", 0),
                      prime_floor=_int(text, "engram_vocab_size", 0),
                      compressed_vocab=_int(text, "engram_compressed_vocab_size", 0),
                      pad_id=_int(text, pad, -1))


def _check_engram(e: EngramSpec, n_layers: int) -> None:
    if list(e.layers) != sorted(set(e.layers)) or any(not 0 <= i < n_layers for i in e.layers):
        raise CheckpointError(f"engram_layer_ids {list(e.layers)} must be increasing layer ids "
                              f"below {n_layers}")
    for key, value, least in (("engram_max_ngram_size", e.max_ngram, 2),
                              ("engram_n_heads", e.heads, 1), ("engram_head_dim", e.head_dim, 1),
                              ("engram_vocab_size", e.prime_floor, 2),
                              ("engram_compressed_vocab_size", e.compressed_vocab, 1),
                              ("engram_pad_id", e.pad_id, 0)):
        if value < least:
            raise CheckpointError(f"{key} = {value}: must be at least {least} with "
                                  "engram_layer_ids set")
    want = table_rows(e)
    if list(e.rows) != want:
        raise CheckpointError(f"engram_num_embeddings {list(e.rows)}: the hash layout of "
                              f"engram_vocab_size {e.prime_floor}, engram_max_ngram_size "
                              f"{e.max_ngram} and engram_n_heads {e.heads} gives tables of "
                              f"{want} rows")


def _kvmesh_mtp_layers(text: dict) -> int:
    """kvmesh's own fields sit under one key, `"kvmesh": {...}`, apart from DeepSeek's."""
    own = text.get("kvmesh") or {}
    if not isinstance(own, dict):
        raise CheckpointError(f"field 'kvmesh' must be an object, got {own!r}")
    return _int(own, "mtp_layers", 0)


def _ids(raw: dict, key: str) -> tuple[int, ...]:
    ids = raw.get(key) or []
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CheckpointError(f"field {key!r} must be a list of integers, got {ids!r}")
    return tuple(ids)
