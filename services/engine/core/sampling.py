"""Sampling parameters, their validation, and token sampling.

Randomness is a function of (seed, index of the token being generated), not of
a generator's history, so a preempted and recomputed sequence draws the same
tokens it would have drawn without preemption.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmesh.errors import InvalidArgument
from kvmesh.generation import (
    DEFAULT_MAX_TOKENS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    TokenLogprob,
)

# Engines are reachable by every peer, not only through the gateway (whose own limits,
# `--max-stop` and `--max-stop-bytes`, default to 16 and 256), so they bound stop work too.
MAX_STOPS = 64              # stop strings, and stop token ids, each
MAX_STOP_BYTES = 1024       # UTF-8 bytes per stop string


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    speculative: str = ""       # "" = the engine's setting; "off" or METHOD:K (bounded by it)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None   # None: none; k: each token's log-probability and the k likeliest

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {self.max_tokens}")
        bad = [i for i in self.stop_token_ids if not 0 <= i < vocab_size]
        if bad:
            raise InvalidArgument(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        if len(self.stop) > MAX_STOPS or len(self.stop_token_ids) > MAX_STOPS:
            raise InvalidArgument(f"{len(self.stop)} stop strings and {len(self.stop_token_ids)} "
                                  f"stop_token_ids given; at most {MAX_STOPS} of each")
        for i, s in enumerate(self.stop):
            if s == "":
                raise InvalidArgument(f"stop[{i}] is empty; stop strings must not be empty")
            if len(s.encode()) > MAX_STOP_BYTES:
                raise InvalidArgument(f"stop[{i}] has {len(s.encode())} bytes; at most "
                                      f"{MAX_STOP_BYTES}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed must be in [0, 2**63)")
        if not 0 <= self.min_p <= 1:                     # NaN fails too
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]"
                                  f" (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Do this request's logits depend on the tokens before them (penalize())?"""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def draftable(self) -> bool:
        """May speculative drafts be verified for this request? Not with penalties (a
        verified row's would need the drafts before it in its history) nor logprobs (each
        token's are read from the row that chose it, one per step)."""
        return not self.penalized and self.logprobs is None


def token_logprobs(rows: list[tuple[torch.Tensor, int, int]]) -> list[TokenLogprob]:
    """(logits [V], chosen id, k) of each row -> its TokenLogprob, from the log-softmax of
    the model's own logits: before penalties, temperature and truncation, what vLLM
    reports by default (`raw_logprobs`). Two host reads for all the rows; only requests
    that ask for logprobs come here."""
    if not rows:
        return []
    lp = torch.log_softmax(torch.stack([r[0] for r in rows]).float(), -1)
    at = torch.tensor([[n, r[1]] for n, r in enumerate(rows)], device=lp.device)
    chosen = lp[at[:, 0], at[:, 1]]
    top = torch.topk(lp, max(r[2] for r in rows))           # k = 0 gives empty columns
    values = torch.cat([chosen[:, None], top.values], 1).tolist()
    return [TokenLogprob(v[0], tuple(zip(i[:k], v[1:1 + k], strict=True)))
            for (_, _, k), v, i in zip(rows, values, top.indices.tolist(), strict=True)]


def penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
             output: list[int]) -> torch.Tensor:
    """The logits a token is chosen from, after vLLM's and OpenAI's penalties: each token
    seen in the prompt or the output has its logit divided by repetition_penalty when
    positive, multiplied when negative (CTRL's form); each token of the output loses
    frequency_penalty per occurrence and presence_penalty once. Greedy choices see them
    too. `output` holds every generated token, a resumed stream's included."""
    if not params.penalized:
        return logits
    x = logits.float().clone()
    out = torch.tensor(output, dtype=torch.long, device=x.device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        seen[_distinct(prompt, x.device)] = True
        seen[out] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = out.unique(return_counts=True)
        x[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    return x


# A prompt's distinct ids, made once per prompt and kept for the last few hundred: a
# request's prompt list never changes, and building them on every step cost ~10 ms at 64K
# tokens. Keyed by the list's identity; the entry holds the list, so the id is not reused.
_PROMPT_IDS: OrderedDict[int, tuple[list[int], torch.Tensor]] = OrderedDict()
_PROMPTS_KEPT = 256


def _distinct(prompt: list[int], device: torch.device) -> torch.Tensor:
    entry = _PROMPT_IDS.get(id(prompt))
    if entry is None or entry[0] is not prompt or entry[1].device != device:
        entry = (prompt, torch.tensor(prompt, dtype=torch.long, device=device).unique())
        _PROMPT_IDS[id(prompt)] = entry
        if len(_PROMPT_IDS) > _PROMPTS_KEPT:
            _PROMPT_IDS.popitem(last=False)
    _PROMPT_IDS.move_to_end(id(prompt))
    return entry[1]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: temperature, then min_p, top_k and top_p
    (float64; vLLM's order). Speculative verification applies the same function to the
    draft's distribution (core/speculative.py), so p and q are truncated alike."""
    x = logits.double() / params.temperature
    if params.min_p > 0:
        # log p_i < log(min_p) + log p_max  <=>  p_i < min_p * p_max; the top token stays
        x = x.masked_fill(x < x.max() + math.log(params.min_p), float("-inf"))
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p   # always keeps the top token
        # scattered, not mask[order[keep]]: a boolean index would read its size back
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def generator(params: SamplingParams, step: int, request_seed: int,
              device: str | torch.device = "cpu") -> torch.Generator:
    """The random source of token `step` of a request (speculative verification draws each
    row's token from this same source: core/speculative.py)."""
    seed = params.seed if params.seed is not None else request_seed
    # on the caller's device (sampling draws on the logits' device, no host copy of the
    # distribution); a CUDA generator draws other numbers than the CPU one for the same seed,
    # so sampled tokens are reproducible per device
    return torch.Generator(device=device).manual_seed(
        (seed * 1_000_003 + step) % (2**63))


def draw_one(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index drawn from `probs` ([V] or [n, V]), as torch.multinomial(probs, 1) draws it:
    the index of the largest probs / E with E ~ Exp(1) from `gen` (the same numbers, tested
    in tests/engine/core/test_host_reads.py). Not multinomial itself: before drawing it checks its
    input with a flag that it reads back to the host, a sync per draw on a GPU."""
    e = torch.empty_like(probs).exponential_(1, generator=gen)
    return torch.argmax(probs / e, dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams, step: int, request_seed: int) -> int:
    """logits: [V] -> token id. `step` = how many tokens this request has generated."""
    return sample_ids([(logits, params, step, request_seed)])[0]


def draw(logits: torch.Tensor, params: SamplingParams, step: int,
         request_seed: int) -> torch.Tensor:
    """The token of one row as a 0-d long tensor on the logits' device (no host read)."""
    if params.greedy:
        return torch.argmax(logits)
    probs = target_probs(logits, params)
    gen = generator(params, step, request_seed, device=probs.device)
    return draw_one(probs, gen)[0]


def draw_batch(rows: list[tuple[torch.Tensor, SamplingParams, int, int]]
               ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """draw() of every (logits [V], params, step, request seed) row, for one read_ids:
    (parts, where) with row i's id at parts[where[i][0]][where[i][1]]. The greedy rows take
    one argmax over their stacked logits (the same index: argmax keeps the first maximum
    either way) instead of one op per row: 32 rows, 1 thread: ~130 -> ~15 us."""
    greedy = [i for i, row in enumerate(rows) if row[1].greedy]
    greedy = greedy if len(greedy) > 1 else []          # one greedy row: draw() as any other
    parts = [torch.stack([rows[i][0] for i in greedy]).argmax(-1)] if greedy else []
    where = {i: (0, j) for j, i in enumerate(greedy)}
    for i, row in enumerate(rows):
        if i not in where:
            where[i] = (len(parts), 0)
            parts.append(draw(*row))
    return parts, [where[i] for i in range(len(rows))]


def read_ids(parts: list[torch.Tensor]) -> list[list[int]]:
    """Long tensors on the device (0-d or 1-D) -> their values, in ONE host read. This is
    the engine's one device sync per step (Engine.step): the sampled ids and the
    speculative verdicts are the only numbers the host must see to go on (stops, block
    hashes, the next step's tokens)."""
    if not parts:
        return []
    flat = torch.cat([t.reshape(-1) for t in parts]).tolist()
    out, at = [], 0
    for t in parts:
        out.append(flat[at : at + t.numel()])
        at += t.numel()
    return out


def sample_ids(rows: list[tuple[torch.Tensor, SamplingParams, int, int]]) -> list[int]:
    """Tokens of many rows (logits [V], params, step, request seed), each drawn on its logits'
    device with its own generator; ONE host read for all of them (read_ids)."""
    return [ids[0] for ids in read_ids([draw(*row) for row in rows])]


def attach_logprobs(events: list[Any], logits: list[torch.Tensor],
                    wanted: list[int | None]) -> None:
    """Give each event whose request asked (`wanted` k not None) the TokenLogprob of its one
    token, read from the logits row that chose it (events, logits and wanted in step)."""
    rows = [(row, ev.token_ids[0], k) for ev, row, k in zip(events, logits, wanted, strict=True)
            if k is not None]
    found = iter(token_logprobs(rows))
    for ev, k in zip(events, wanted, strict=True):
        if k is not None:
            ev.logprobs = [next(found)]
