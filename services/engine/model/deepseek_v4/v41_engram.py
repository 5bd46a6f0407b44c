"""DeepSeek V4.1's Engram: a hashed n-gram memory written into the residual streams at a few
layers (`engram_layer_ids`; 1 and 14 on V4.1-Flash), before that layer's attention mixes them.

Per token and Engram layer, from the token and its n - 1 predecessors:

    token ids ─ tokenizer-normalized map ─ compressed ids c_0 (the token) .. c_{n-1}
    for g = 2..n:  h_g = (c_0 m_0) xor .. xor (c_{g-1} m_{g-1})      one odd multiplier m_s
                   row[g, k] = h_g mod p_{g,k} + offset_{g,k}           per head k: its prime
    table rows [(n - 1) x heads, head_dim] ─ flatten ─ wkv ─ n keys + one value  [(n + 1) D]
    per stream j: gate_j = sigmoid(signed sqrt(<stream_j q_j k_j, key_j> / rms / rms / sqrt D))
                  stream_j += gate_j value

The compressed map folds token ids whose text is the same after NFKC, accent stripping,
lower-casing and whitespace collapsing; a predecessor before the sequence's start counts as
the pad token. The primes are one ascending run of distinct primes from `engram_vocab_size`
on, drawn in (layer, n-gram size, head) order, so a layer's table has as many rows as its
primes sum to (384,006,168 and 384,016,682 on V4.1-Flash: the test pins both). The
multipliers come from NumPy's PCG64 seeded with 10007 x the layer id. All of that must match
DeepSeek's training bit for bit, or every lookup reads another row: read from the public
descriptions of the release (SGLang's and llama.cpp's V4.1 support), not from a checkpoint
run, which no offline test can do.

Engram keeps no state of its own: a row's lookup depends on token ids only, so a cached
sequence needs nothing beyond its last n - 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TOKEN_MAP = "engram.token_map"     # the weights' entry the loader puts the compressed map in
ENGRAM_TABLE = "engram.embed.weight"   # a layer's table: FP8 (with `engram.embed.scale`) or float
GATE_FLOOR = 1e-6        # |dot| is floored here before its square root
_SEED = 10007            # the multipliers' generator is seeded with _SEED x layer id


@dataclass(frozen=True)
class EngramSpec:
    """The config's `engram_*` fields."""
    layers: tuple[int, ...]        # engram_layer_ids
    rows: tuple[int, ...]          # engram_num_embeddings: each layer's table rows
    max_ngram: int                 # n: 2-grams up to n-grams are hashed
    heads: int                     # hashes (primes) per n-gram size
    head_dim: int                  # one table row's width
    prime_floor: int               # engram_vocab_size: every prime is at least this
    compressed_vocab: int          # distinct ids of the normalized tokenizer
    pad_id: int                    # the token a predecessor before the start counts as

    @property
    def columns(self) -> int:
        """Table rows read per token and layer."""
        return (self.max_ngram - 1) * self.heads


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (these bases decide every n below 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=8)
def bucket_primes(spec: EngramSpec) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[layer][n-gram size - 2][head]: each hash's prime modulus."""
    out, p = [], spec.prime_floor - 1
    for _ in spec.layers:
        sizes = []
        for _ in range(spec.max_ngram - 1):
            heads = []
            for _ in range(spec.heads):
                p += 1
                while not _is_prime(p):
                    p += 1
                heads.append(p)
            sizes.append(tuple(heads))
        out.append(tuple(sizes))
    return tuple(out)


def table_rows(spec: EngramSpec) -> list[int]:
    """The rows each layer's table must have: the sum of its primes."""
    return [sum(sum(size) for size in layer) for layer in bucket_primes(spec)]


def multipliers(spec: EngramSpec) -> torch.Tensor:
    """[layers, n] int64: odd, and small enough that a compressed id times one fits int64."""
    bound = max(1, (2**63 - 1) // spec.compressed_vocab // 2)
    return torch.stack([
        torch.from_numpy(np.random.default_rng(_SEED * layer)
                         .integers(0, bound, size=spec.max_ngram, dtype=np.int64) * 2 + 1)
        for layer in spec.layers])


def compressed_token_map(tokenizer_file: str | Path) -> tuple[list[int], int]:
    """tokenizer.json -> (token id -> compressed id, the number of compressed ids). Ids are
    handed out in token-id order as new normalized texts appear."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    space = "\ue000"      # keeps a token that is one whitespace run from stripping to ""
    normalize = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), space), normalizers.Strip(),
        normalizers.Replace(space, " ")]).normalize_str
    ids: dict[str, int] = {}
    out = []
    for token in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token], skip_special_tokens=False)
        # a token holding part of a UTF-8 character has no text: keyed by its stored form
        key = (tok.id_to_token(token) or "") if "\ufffd" in text else (normalize(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


class EngramHasher:
    """Token ids -> every Engram layer's table rows. Read-only once built."""

    def __init__(self, spec: EngramSpec, token_map: torch.Tensor):
        self.spec, self.token_map = spec, token_map.long()
        device = token_map.device
        self.pad = int(self.token_map[spec.pad_id])
        self.mult = multipliers(spec).to(device)                              # [L, n]
        self.primes = torch.tensor(bucket_primes(spec), device=device)        # [L, n-1, H]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, 1) - flat                           # [L, cols]

    def rows(self, ids: torch.Tensor, before: torch.Tensor | list[int]) -> torch.Tensor:
        """ids [S]: consecutive tokens of one sequence; before: the tokens right before
        ids[0] (its last n - 1 are read; fewer only when the sequence starts there).
        Returns [S, layers, columns] table rows."""
        n = self.spec.max_ngram
        before = torch.as_tensor(before, dtype=torch.long, device=ids.device)[-(n - 1):]
        context = torch.cat([before, ids.long()])
        at = torch.arange(ids.shape[0], device=ids.device).view(-1, 1) + before.shape[0] \
            - torch.arange(n, device=ids.device)                            # [S, n]: s-th back
        tokens = context[at.clamp(min=0)]
        # ids past the tokenizer (a padded vocabulary) read the last entry, as SGLang does
        tokens = self.token_map[tokens.clamp(max=self.token_map.shape[0] - 1)]
        compressed = torch.where(at < 0, self.pad, tokens)
        products = compressed.unsqueeze(1) * self.mult                      # [S, L, n]
        rolling, out = products[..., 0], []
        for g in range(1, n):
            rolling = torch.bitwise_xor(rolling, products[..., g])
            out.append(rolling.unsqueeze(-1) % self.primes[:, g - 1])      # [S, L, H]
        return torch.cat(out, dim=-1) + self.offsets


def lookup(w: dict, rows: torch.Tensor) -> torch.Tensor:
    """Table rows [..., head_dim]. A table kept as stored (FP8, `embed.scale` the UE8M0
    exponent of each run of 32) is dequantized here, for the rows read only: V4.1-Flash's
    two tables are 203 GB so, twice that in bf16."""
    table = w["embed.weight"]
    if table.dtype != torch.float8_e4m3fn:
        return F.embedding(rows, table)
    values = table.view(torch.uint8)[rows].view(torch.float8_e4m3fn).float()
    scale = torch.exp2(w["embed.scale"][rows].float() - 127)
    return (values.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)


def write(streams: torch.Tensor, rows: torch.Tensor, w: dict, eps: float,
          wide: torch.dtype) -> torch.Tensor:
    """One Engram layer: streams [S, n, D], rows [S, columns] (this layer's) and its weights
    (`embed.weight` [table rows, head_dim] (`lookup`), `wkv.weight`, `q_weight`,
    `k_weight` [n, D])
    -> the streams with each one's gated share of the looked-up value added."""
    n, d = streams.shape[-2:]
    looked_up = lookup(w, rows).flatten(-2).to(streams.dtype)
    kv = F.linear(looked_up, w["wkv.weight"])
    key, value = kv.to(wide).split([n * d, d], dim=-1)
    key, h = key.unflatten(-1, (n, d)), streams.to(wide)
    scale = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (w["q_weight"].to(wide) * w["k_weight"].to(wide)) * key).sum(-1) * scale * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(streams.dtype)
