"""What one engine step computes: each running request's tokens for the forward.

Every decode row first (its one pending token and the drafts it verifies), then prefill
chunks in admission order within --max-batched-tokens and --long-prefill-chunk (and, beside
decodes, the prefill cap --step-slo-ms sets: step_budget.py), a chunk ending at its
request's snapshot position so the snapshot is taken there. A pure function of the
requests, the drafts and the settings; Engine.step calls it once a step.
"""

from __future__ import annotations

from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.request import Request
from kvmesh.services.engine.core.step_budget import StepBudget


def plan(reqs: list[Request], drafts: dict[str, list[int]], ecfg: EngineConfig,
         step_budget: StepBudget) -> list[tuple[Request, list[int]]]:
    """(request, token ids) for this step, decode rows before prefill chunks."""
    budget = ecfg.max_batched_tokens
    decodes = [r for r in reqs if r.pending == 1]
    works = [(r, r.tokens[-1:] + drafts.get(r.request_id, [])) for r in decodes]
    rows = sum(len(ids) for _, ids in works)
    budget -= rows
    cap = step_budget.prefill_cap(rows)
    if cap is not None:
        budget = min(budget, cap)
    for req in reqs:
        if req.pending <= 1 or budget <= 0:
            continue
        n = min(req.pending, budget)
        if ecfg.long_prefill_chunk:
            n = min(n, ecfg.long_prefill_chunk)
        if req.snapshot_at is not None:
            n = min(n, req.snapshot_at - req.seq.length)
        start = req.seq.length
        works.append((req, req.tokens[start:start + n]))
        budget -= n
    return works
