"""Ring sizes of the state ledger.

    inference SWA ring  = W + B                             (128 + 6 = 134)
    kvstore SWA ring    = inference + EXTRA + YOCO_KEEP     (134 + 128 + 134 = 396)
                          only with KVMESH_PREFILL_STORE_EXTRA_STATE on; YOCO_KEEP
                          only counts while truncation is on
    compression ring    = m + B                             (tail of the open group + rollback history)

Sizes read the environment once and are cached: a pool allocated with one size
must not silently meet code computing another. After changing the environment,
call `clear_ring_size_cache()` before building new pools.
"""

from __future__ import annotations

import functools

from kvmesh import envs


@functools.cache
def max_backtrack() -> int:
    b = envs.max_backtracking_tokens()
    if b < 0:
        raise ValueError("KVMESH_MAX_BACKTRACKING_TOKENS must be >= 0")
    return b


@functools.cache
def inference_swa_ring(window: int) -> int:
    return window + max_backtrack()


@functools.cache
def yoco_store_extra_tokens() -> int:
    if envs.yoco_truncation_mode() == "off":
        return 0
    return max(0, envs.yoco_keep_tokens())


@functools.cache
def kvstore_swa_ring(window: int) -> int:
    extra = 0
    if envs.prefill_store_extra_state():
        extra = envs.prefill_store_extra_size() + yoco_store_extra_tokens()
    return inference_swa_ring(window) + extra


@functools.cache
def compress_ring(m: int) -> int:
    return m + max_backtrack()


def clear_ring_size_cache() -> None:
    """Forget cached sizes; the next call reads the environment again."""
    for fn in (max_backtrack, inference_swa_ring, yoco_store_extra_tokens, kvstore_swa_ring,
               compress_ring):
        fn.cache_clear()
