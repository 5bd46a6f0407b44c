"""Reading a DeepSeek V4 (or V4.1) checkpoint directory into (config, weights).

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensors are read one at a time through `safe_open`, after
the plan has been checked against the config from the files' headers (the quantization
settings, the memory the weights will take, every name, every unquantized tensor's shape),
so those failures come before any weight is read; a quantized tensor's shape is checked
once it is dequantized. Every failure is one `CheckpointError` line naming the file and
the tensor.

Names are DeepSeek's or transformers' (`names.py`; V4.1's: `v41_names.py`); FP8 and FP4 weights are dequantized
(`quant.py`). A V4.1 checkpoint with Engram layers also yields the tokenizer's compressed
token map (as the weight `engram.token_map`), from its tokenizer.json.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from kvmesh.services.engine.model.deepseek_v4 import names, parallel, quant, v41_names
from kvmesh.services.engine.model.deepseek_v4.config import V4Config, read_config
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.parallel import Split
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config, read_v41_config
from kvmesh.services.engine.model.deepseek_v4.v41_engram import (
    ENGRAM_TABLE,
    TOKEN_MAP,
    compressed_token_map,
)

log = logging.getLogger(__name__)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
_FP8 = (torch.float8_e4m3fn,)
_PACKED = (torch.int8, torch.uint8)
# MTP modules are read whole on every rank of a split engine (parallel.py)
MTP_PREFIXES = ("mtp.", v41_names.MTP)


def tensor_files(directory: Path) -> dict[str, Path]:
    """stored tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        files = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise CheckpointError(f"{index}: lists {file.name}, which is not in {directory}")
        return files
    single = directory / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    return {name: single for name in _keys(single)}


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(file, "pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


class _Reader:
    """Open safetensors handles, one per file, and the stored tensors' shapes and dtypes."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}

    def handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, "pt")
            except Exception as exc:
                raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self.handle(name).get_slice(name).get_shape())
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.files[name]}: tensor {name} is missing or unreadable "
                                  f"({exc})") from None

    def read(self, name: str, rows: range | None = None) -> torch.Tensor:
        """The tensor, or only its rows (first dim) in `rows`: those alone are read."""
        try:
            if rows is None:
                return self.handle(name).get_tensor(name)
            return self.handle(name).get_slice(name)[rows.start:rows.stop]
        except Exception as exc:
            raise CheckpointError(f"{self.files[name]}: tensor {name} cannot be read ({exc})") from None


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32,
                    split: Split | None = None) -> tuple[V4Config, dict[str, torch.Tensor]]:
    """A DeepSeek V4 checkpoint (its MTP modules too, when it has them). split: only one
    rank's share of a tp x ep engine (parallel.py): of the routed experts, only the rank's
    are read; every other tensor is read one at a time and cut."""
    directory = _directory(directory)
    cfg = read_config(directory)

    def expected(plan: dict) -> dict:
        shapes = names.expected_shapes(cfg)
        if any(name.startswith("mtp.") for name in plan):   # optional: read whole when present
            shapes.update(names.mtp_shapes(cfg))
        return shapes
    return cfg, _load(directory, cfg, expected, dtype, lambda name: _what(cfg, name), split)


def load_v41_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32,
                        split: Split | None = None) -> tuple[V41Config, dict[str, torch.Tensor]]:
    """A DeepSeek V4.1 checkpoint's text model (v41_names.py says what is read); split: one
    rank's share, as load_checkpoint."""
    directory = _directory(directory)
    cfg = read_v41_config(directory)

    def expected(plan) -> dict[str, tuple[int, ...]]:
        for line in v41_names.unserved(plan, cfg):     # served without them: say so once
            log.warning("%s: not used by kvmesh: %s", directory, line)
        return v41_names.expected_shapes(cfg)

    weights = _load(directory, cfg, expected, dtype, lambda name: v41_names.describe(cfg, name),
                    split)
    if cfg.engram is not None:
        weights[TOKEN_MAP] = engram_token_map(directory, cfg)
    return cfg, weights


def engram_token_map(directory: Path, cfg: V41Config) -> torch.Tensor:
    """Engram hashes token ids through the tokenizer's normalized vocabulary (v41_engram.py):
    built from the checkpoint's tokenizer.json, checked against the config's count."""
    assert cfg.engram is not None
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; the Engram layers {list(cfg.engram.layers)} "
                              "hash token ids through this tokenizer's normalized vocabulary")
    mapping, distinct = compressed_token_map(file)
    if distinct != cfg.engram.compressed_vocab:
        raise CheckpointError(f"{file}: normalizes to {distinct} distinct tokens, but "
                              f"engram_compressed_vocab_size in config.json is "
                              f"{cfg.engram.compressed_vocab} (every Engram hash depends on it)")
    if cfg.engram.pad_id >= len(mapping):
        raise CheckpointError(f"engram_pad_id {cfg.engram.pad_id} is past {file}'s "
                              f"{len(mapping)} tokens")
    return torch.tensor(mapping, dtype=torch.long)


def _directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    return directory


def _load(directory: Path, cfg, expected_of, dtype: torch.dtype, what,
          split: Split | None = None) -> dict[str, torch.Tensor]:
    """Check the plan against `expected_of(plan)` ({name: shape}), then read and dequantize
    each tensor (a rank's share of it, given a split); what(name) says which part of the
    config a missing tensor belongs to."""
    block = _fp8_block(cfg, directory)
    reader = _Reader(tensor_files(directory))
    plan, scales = _plan(reader)
    expected = expected_of(plan)
    if split is not None:
        split.check(cfg)
    _check_memory(expected if split is None else _shares(expected, cfg, split), dtype, directory)
    _check_plan(cfg, expected, plan, scales, reader, directory, what)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        pieces = plan[name]
        rows = _held_rows(name, cfg, split)
        kept = _kept_fp8(name, pieces, reader, scales, shape)
        if kept is not None:
            weights[name], weights[name[:-len("weight")] + "scale"] = kept
            continue
        value = _assemble(name, shape, pieces, reader, scales, block, rows)
        want = shape if rows is None else (len(rows), *shape[1:])
        if value.shape != want:  # quantized or stacked: known once read
            stored = pieces[0][2]
            raise CheckpointError(f"{reader.files[stored]}: tensor {stored} has shape "
                                  f"{list(value.shape)}, expected {list(want)}")
        if split is not None and not name.startswith(MTP_PREFIXES):
            value = parallel.shard(name, value, cfg, split, experts_cut=True)
        weights[name] = _cast(name, value, dtype)
    unused = sorted(set(plan) - set(expected))
    if unused:
        log.warning("%s: %d tensors not used by the config (first: %s)", directory, len(unused),
                    unused[0])
    return weights


def _kept_fp8(name: str, pieces, reader: _Reader, scales: dict[str, str], shape
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An Engram table stored FP8 with a UE8M0 scale per 1 x 32 run stays so: (values,
    scale exponents as uint8); its rows are dequantized when looked up (v41_engram.py).
    None for any other tensor (dequantized at load)."""
    stored = pieces[0][2]
    if not name.endswith(ENGRAM_TABLE) or stored not in scales:
        return None
    scale = reader.read(scales[stored])          # (float32 scales: dequantized at load)
    if scale.dtype != torch.float8_e8m0fnu or \
            tuple(scale.shape) != (shape[0], shape[1] // quant.FP4_RUN):
        return None
    value = reader.read(stored)
    return (value, scale.view(torch.uint8)) if value.dtype in _FP8 and \
        tuple(value.shape) == shape else None


def _held_rows(name: str, cfg, split: Split | None) -> range | None:
    """The experts (first dim) of a stacked routed-expert tensor a rank holds; None: all."""
    if split is None or not name.startswith("layers.") or \
            not name.endswith(("experts.w13", "experts.w2")):
        return None
    return parallel.experts_held(cfg, split)


def _shares(expected: dict, cfg, split: Split) -> dict:
    """The shapes of a rank's shares (for the memory check), cut on the meta device."""
    return {name: shape if name.startswith(MTP_PREFIXES) else
            tuple(parallel.shard(name, torch.empty(shape, device="meta"), cfg, split).shape)
            for name, shape in expected.items()}


def _plan(reader: _Reader):
    """package name -> [(expert, part, stored name)], and weight name -> its scale's name."""
    plan: dict[str, list[tuple[int | None, str | None, str]]] = {}
    scales: dict[str, str] = {}
    for stored in reader.files:
        owner = names.scale_of(stored)
        if owner is not None and owner[0] in reader.files:
            scales[owner[0]] = stored
            continue
        src = names.source(stored)
        if src is not None:
            plan.setdefault(src.name, []).append((src.expert, src.part, stored))
    return plan, scales


def _check_plan(cfg, expected, plan, scales, reader, directory, what) -> None:
    """Before any tensor is read: every expected tensor (and every expert's part) is there,
    and every one stored whole and unquantized has its expected shape (from the header)."""
    for name, shape in expected.items():
        pieces = plan.get(name)
        if not pieces:
            raise CheckpointError(f"{directory}: missing tensor {name} (expected shape "
                                  f"{list(shape)}) for the config's {what(name)}")
        if pieces[0][0] is None:
            stored = pieces[0][2]
            if stored not in scales and reader.shape(stored) != shape:
                raise CheckpointError(f"{reader.files[stored]}: tensor {stored} has shape "
                                      f"{list(reader.shape(stored))}, expected {list(shape)}")
            continue
        have = _per_expert(pieces)
        for e in range(shape[0]):
            for part in _parts(name):
                if part not in have.get(e, {}):
                    raise CheckpointError(f"{reader.files[pieces[0][2]]}: missing tensor "
                                          f"{name.rsplit('.', 1)[0]}.{e}.{part}.weight "
                                          f"(the config has {cfg.n_experts} experts)")


def _per_expert(pieces) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for expert, part, stored in pieces:
        out.setdefault(expert, {})[part] = stored
    return out


def _parts(name: str) -> tuple[str, ...]:
    return ("w2",) if name.endswith("w2") else ("w1", "w3")


def _assemble(name, shape, pieces, reader, scales, block, rows: range | None = None
              ) -> torch.Tensor:
    """The tensor `name` from its stored pieces; rows: only those experts (first dim)."""
    if pieces[0][0] is None:  # stored whole
        return _read(pieces[0][2], reader, scales, block, rows)
    have = _per_expert(pieces)
    return torch.stack([torch.cat([_read(have[e][p], reader, scales, block) for p in _parts(name)])
                        for e in (range(shape[0]) if rows is None else rows)])


def _read(stored: str, reader: _Reader, scales: dict[str, str], block: int,
          rows: range | None = None) -> torch.Tensor:
    """A stored tensor, dequantized; rows: only those (first dim). A quantized one is read
    whole and cut once dequantized (its scales cover blocks of rows)."""
    scale_name = scales.get(stored)
    if rows is not None and scale_name is not None:
        return _read(stored, reader, scales, block)[rows.start:rows.stop]
    value = reader.read(stored, rows)
    if value.dtype in _FP8 or (value.dtype in _PACKED and scale_name):
        if scale_name is None:
            raise CheckpointError(f"{reader.files[stored]}: tensor {stored} is {value.dtype} "
                                  "without a scale tensor (.scale or .weight_scale_inv)")
        scale = reader.read(scale_name)
        if value.dtype in _FP8:
            want = (-(-value.shape[0] // block), -(-value.shape[1] // block))
            if tuple(scale.shape) == (value.shape[0], value.shape[1] // quant.FP4_RUN) != want:
                return quant.dequant_fp8_runs(value, scale)      # 1 x 32 runs (Engram tables)
            if tuple(scale.shape) != want:
                raise CheckpointError(f"{reader.files[scale_name]}: tensor {scale_name} has "
                                      f"shape {list(scale.shape)}, expected {list(want)} "
                                      f"({block} x {block} blocks of {stored})")
            return quant.dequant_fp8(value, scale, block)
        if not quant.fp4_shape_ok(value.shape, scale.shape):
            raise CheckpointError(f"{reader.files[scale_name]}: tensor {scale_name} has shape "
                                  f"{list(scale.shape)}, not one FP4 scale per 32 values of "
                                  f"{stored} {list(value.shape)}")
        return quant.dequant_fp4(value, scale)
    if not (value.is_floating_point() or stored.endswith("tid2eid")):
        raise CheckpointError(f"{reader.files[stored]}: tensor {stored} has dtype {value.dtype}, "
                              "expected a floating-point type")
    return value


def _cast(name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("tid2eid"):
        return value.long()
    if dtype.itemsize < 4 and names.keeps_fp32(name):
        return value.float()
    return value.to(dtype)


def _fp8_block(cfg: V4Config | V41Config, directory: Path) -> int:
    q = cfg.quantization
    if q is None:
        return 128
    method = q.get("quant_method")
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{directory / 'config.json'}: unsupported quantization "
                              f"(quant_method {method!r}, fmt {q.get('fmt')!r}); this reader "
                              "takes fp8 e4m3 with block scales and fp4 experts")
    size = q.get("weight_block_size", [128, 128])
    if len(size) != 2 or size[0] != size[1]:
        raise CheckpointError(f"{directory / 'config.json'}: unsupported weight_block_size "
                              f"{size} (expected square blocks such as [128, 128])")
    expert = q.get("expert_dtype")
    if expert not in (None, "fp4", "fp8", "bf16"):
        raise CheckpointError(f"{directory / 'config.json'}: unsupported expert_dtype {expert!r}")
    return int(size[0])


def _check_memory(expected: dict, dtype: torch.dtype, directory: Path) -> None:
    # (an Engram table kept in FP8 is counted at the dtype's size too: an upper bound)
    need = sum(math.prod(s) for s in expected.values()) * dtype.itemsize
    available = _available_bytes()
    if available is not None and need > available:
        raise CheckpointError(f"{directory}: the weights take {need / 2**30:.1f} GiB as {dtype}, "
                              f"more than the {available / 2**30:.1f} GiB of memory available")


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _what(cfg: V4Config, name: str) -> str:
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return f"layer {i} ({cfg.layer_kinds[i]} attention, {cfg.mlp_kinds[i]} MoE)"
    if name.startswith("mtp."):
        return f"MTP module {name.split('.')[1]} (its other mtp.* tensors are there)"
    return "model"
