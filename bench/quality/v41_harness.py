"""The engine side of bench/quality/replay_v41.py: requests run through a real in-process
Engine serving a DeepSeek V4.1 checkpoint, with teacher-forced continuations.

A forced request is the prompt alone, generating n tokens whose sampled ids are replaced by
the continuation's (the engine's own decode rows, one per step, as a user's request would
run; only the token fed back differs). The harness keeps the logits row each of those n
tokens was sampled from: the prompt's last row (from the prefill or the bounded replay),
then each decode row. A free-running greedy request is the same without the replacement.
A variant's greedy agreement is read from a forced pass over the exact path's greedy
tokens: its own free-running greedy would follow them up to the first row whose argmax
differs, which is therefore its first divergence.

Requests that must see the same cache state are submitted together and admitted in one
step (make_engine leaves room for all of them).
"""

from __future__ import annotations

import time

import torch

from bench.quality.forcing import Out, Req
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4.ledgers import BLOCK
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model

# Prompt tokens per sequence per step: V4.1's prefill costs less per token in long chunks.
CHUNK = 256


class ForcingV41Engine(Engine):
    """Engine whose forced requests (`forced`: request id -> the ids to feed back) take the
    given ids instead of the sampled ones, and which keeps, for every request, the logits
    row each output token was sampled from. It wraps three of the engine's own calls (the
    forward, the bounded replay and the emission) instead of changing the engine for a
    measurement."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.forced: dict[str, list[int]] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.first_row_at: dict[str, float] = {}

    def _keep(self, req, row: torch.Tensor) -> None:
        self.rows.setdefault(req.request_id, []).append(row.detach().clone())
        self.first_row_at.setdefault(req.request_id, time.perf_counter())

    def _forward(self, works):
        outs, streams = super()._forward(works)
        for (req, _), out in zip(works, outs, strict=True):
            if req.pending == 0:            # this row is the one the step samples from
                self._keep(req, out[-1])
        return outs, streams

    def _replay(self, req):
        row = super()._replay(req)
        if row is not None:               # None: it stopped at its snapshot, prefill goes on
            self._keep(req, row)
        return row

    def _emit(self, req, tokens):
        given = self.forced.get(req.request_id)
        if given is not None:
            at = len(req.output)
            tokens = given[at: at + len(tokens)]
        return super()._emit(req, tokens)


def make_engine(model: V41Model, tokenizer, n_seqs: int, max_len: int, chunk: int = CHUNK,
                **ecfg) -> ForcingV41Engine:
    """Room for n_seqs running requests of max_len tokens, all admitted in one step (ecfg
    may override any field: truncation, keep_tokens, swa_policy, a smaller store)."""
    base = {"num_slots": n_seqs, "max_running": n_seqs,
            "num_blocks": n_seqs * (max_len // BLOCK + 2) + 64,
            "max_batched_tokens": n_seqs * chunk + 1, "long_prefill_chunk": chunk,
            "snapshot_bytes": 4 << 30, "dtype": str(model.dtype).removeprefix("torch.")}
    return ForcingV41Engine(model, EngineConfig(**{**base, **ecfg}), tokenizer,
                            name="replay-quality")


def run(engine: ForcingV41Engine, reqs: list[Req]) -> dict[str, Out]:
    """Submit every request at once and step until all are done. A Req's `tokens` is its
    prompt; `forced` > 0 means its last `forced` tokens are the continuation to feed back
    (so the prompt is tokens[:-forced])."""
    seqs, t0 = {}, time.perf_counter()
    for r in reqs:
        rid = f"{r.name}#{engine.counters['requests']}"
        prompt = r.tokens[:-r.forced] if r.forced else r.tokens
        if r.forced:
            engine.forced[rid] = r.tokens[-r.forced:]
        params = SamplingParams(temperature=0.0, max_tokens=r.forced or r.greedy,
                                ignore_eos=True)
        seqs[r.name] = engine.add_request(prompt, params, request_id=rid, salt=r.salt)
    while engine.has_work:
        engine.step()
    out = {}
    for name, req in seqs.items():
        rid = req.request_id
        rows = engine.rows.pop(rid, [])
        # start: the first prompt position computed (a replay recomputes its 128 tokens)
        out[name] = Out(torch.stack(rows) if rows else None, list(req.output),
                        req.cached_tokens - req.replayed_tokens,
                        req.cached_tokens, req.replayed_tokens,
                        req.cached_tokens > 0 and req.replayed_tokens == 0,
                        engine.first_row_at.pop(rid, t0) - t0, 0)
        engine.forced.pop(rid, None)
    return out
