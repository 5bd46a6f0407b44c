"""StepBudget: the prefill tokens a step beside decodes may carry to finish within a time target.

Every decoding stream waits for its step, so a step's duration is the inter-token latency of
every stream in it. `--step-slo-ms T` sets that target in milliseconds, a number a user can
hold a deployment to on any hardware (a ratio to a decode-only step means something else on
every machine, and beside a burst of admissions it starves them). The
scheduler first gives every decoding sequence its row(s), then asks for the prefill cap:

    step seconds  ~  a + b * decode_rows + c * prefill_tokens      (least squares over the
                                                                    last WINDOW steps)
    cap  =  max(MIN_PREFILL, floor((T - a - b * decode_rows) / c))

The fit covers every kind of step (prefill only, decodes only, both), so it is there from
the first steps of a burst, when no step is decode-only yet; the rows and tokens of recent
steps vary enough to separate b from c. Until it is (fewer than MIN_STEPS steps, or a fit
with c <= 0), there is no cap and the token budget alone bounds the step. MIN_PREFILL keeps
admission moving when decodes alone exceed T: the target is then missed by what those
tokens cost, rather than new requests never starting.

Off (`--step-slo-ms 0`) and always off in deterministic mode: chunk boundaries that depend
on timing change fp32 results from run to run. The ranks of a split engine fit over rank 0's
steps (`follow`), so they cap alike. Owned by Engine, which reports each step
(`observe`).
Tests inject step times through `observe`.
"""

from __future__ import annotations

from collections import deque

import torch

# Prefill tokens a step with decodes may always carry (see the module docstring).
MIN_PREFILL = 32
# Steps the fit is taken over: long enough to hold steps of several shapes, short enough to
# follow a prompt's growing per-token cost and the machine's drift.
WINDOW = 32
MIN_STEPS = 6


class StepBudget:
    def __init__(self, slo_ms: float):
        if slo_ms < 0:
            raise ValueError(f"step_slo_ms must be >= 0 (0: off), not {slo_ms}")
        self.slo_s = slo_ms / 1e3
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float, float] | None = None
        self._stale = False

    @property
    def active(self) -> bool:
        return self.slo_s > 0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One finished step: its decode rows (drafts included), its prefill (and replayed)
        tokens, and its seconds."""
        if not self.active or seconds <= 0 or not (decode_rows or prefill_tokens):
            return
        self._steps.append((decode_rows, prefill_tokens, seconds))
        self._stale = True

    def steps(self) -> list[tuple[int, int, float]]:
        """The steps the fit is taken over (what `follow` needs to fit the same)."""
        return list(self._steps)

    def follow(self, steps: list[tuple[int, int, float]]) -> None:
        """Fit over `steps` from now on, another engine's (a split engine's ranks take rank
        0's: core/lockstep.py), so every rank caps its prefill alike."""
        self._steps = deque(steps, maxlen=WINDOW)
        self._stale = True

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of the fitted step time, or None while it cannot be fitted."""
        if self._stale:
            self._stale = False
            self._fit = _fit(list(self._steps)) if len(self._steps) >= MIN_STEPS else None
        return self._fit

    def prefill_cap(self, decode_rows: int) -> int | None:
        """Most prefill tokens a step with `decode_rows` decode rows may carry; None: no cap."""
        if not self.active or not decode_rows:
            return None
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c = fit
        return max(MIN_PREFILL, int((self.slo_s - a - b * decode_rows) / c))


def _fit(steps: list[tuple[int, int, float]]) -> tuple[float, float, float] | None:
    # a host-side fit of host-side timings, wherever the model runs
    x = torch.tensor([[1.0, r, t] for r, t, _ in steps], dtype=torch.float64, device="cpu")
    y = torch.tensor([[s] for _, _, s in steps], dtype=torch.float64, device="cpu")
    # columns that never vary (no prefill seen yet, or only one batch size) cannot be told
    # from the constant: they are fitted as 0 and, for c, reported as no fit
    varies = [True] + [bool(x[:, j].std() > 0) for j in (1, 2)]
    if not varies[2]:
        return None
    cols = [j for j in range(3) if varies[j]]
    sol = torch.linalg.lstsq(x[:, cols], y).solution.flatten().tolist()
    coef = [0.0, 0.0, 0.0]
    for j, v in zip(cols, sol, strict=True):
        coef[j] = v
    a, b, c = coef
    if c <= 0:
        return None
    return max(a, 0.0), max(b, 0.0), c
