"""Validation of what callers send: block keys, traffic classes, sizes.

Raises `kvmesh.errors.InvalidArgument` naming the offending value, which the
gRPC layer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvmesh import generation
from kvmesh.errors import InvalidArgument

_KEY = re.compile(r"[0-9a-f]{32,128}")


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        shown = key if isinstance(key, str) and len(key) <= 140 else f"{str(key)[:140]}..."
        raise InvalidArgument(
            f"invalid block key {shown!r}: expected 32..128 lowercase hex characters"
        )
    return key


def check_keys(keys: Iterable[str]) -> list[str]:
    return [check_key(k) for k in keys]


def check_traffic_class(name: str) -> str:
    """A known class name, with "" (none given) filed as chatbot."""
    return generation.check_traffic_class(name) or generation.DEFAULT_TRAFFIC_CLASS


def check_size(key: str, size: int, limit: int) -> int:
    if size < 0 or size > limit:
        raise InvalidArgument(f"object {key} is {size} bytes; the limit is {limit} bytes")
    return size
