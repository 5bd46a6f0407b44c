"""The checks every engine core runs on a new request before it queues anything."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.core.sampling import SamplingParams


def check_prompt(prompt_ids: list[int], params: SamplingParams, resume: int, vocab_size: int,
                 max_seq_len: int) -> int:
    """InvalidArgument naming the field for a bad request; returns the prompt's length
    without the `resume` ids (a mid-stream migration's output so far)."""
    params.validate(vocab_size)
    if not prompt_ids:
        raise InvalidArgument("prompt is empty: give prompt text or prompt_token_ids")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt_token_ids {bad[:5]} are outside [0, {vocab_size})")
    if not 0 <= resume < min(len(prompt_ids), params.max_tokens):
        raise InvalidArgument(f"resume_generated must be in [0, min(prompt length, max_tokens)) "
                              f"= [0, {min(len(prompt_ids), params.max_tokens)}), got {resume}")
    n_prompt = len(prompt_ids) - resume
    if n_prompt + params.max_tokens > max_seq_len:
        raise InvalidArgument(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) "
                              f"exceeds the model's maximum of {max_seq_len} tokens")
    return n_prompt
