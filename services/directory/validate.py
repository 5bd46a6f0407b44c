"""Input checks for directory requests; every failure is `errors.InvalidArgument`.

Pure functions, no I/O. Messages name the offending field and value (clipped)
so an engine developer can fix the call from the status message alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from kvmesh.directory_records import Entry
from kvmesh.errors import InvalidArgument

KEY_RE = re.compile(r"[0-9a-f]{32,128}")
ENGINE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Snapshot positions sit on block boundaries: 128 in every production preset, 16 in the
# shrunk test geometry; 16 is the common alignment the directory insists on.
POSITION_ALIGN = 16
# Positions and sizes travel as uint64 but stay below 2**53 so every JSON or Lua
# consumer reads them exactly.
MAX_EXACT = 2**53


def clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_key(key: str, field: str = "key") -> str:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidArgument(
            f"{field}: {clip(key)} is not a snapshot key (lowercase hex, 32..128 chars)"
        )
    return key


def check_keys(keys: Sequence[str], max_batch: int, field: str = "keys") -> list[str]:
    check_batch(len(keys), max_batch, field)
    return [check_key(k, f"{field}[{i}]") for i, k in enumerate(keys)]


def check_batch(n: int, max_batch: int, field: str) -> None:
    if n > max_batch:
        raise InvalidArgument(f"{field}: {n} items is over the batch limit of {max_batch}")


def check_engine_id(engine_id: str) -> str:
    if not isinstance(engine_id, str) or not ENGINE_ID_RE.fullmatch(engine_id):
        raise InvalidArgument(
            f"engine_id: {clip(engine_id)} must match [A-Za-z0-9._-]{{1,64}}"
        )
    return engine_id


def check_address(address: str) -> str:
    """'host:port' with a hostname, an IPv4 address or a bracketed IPv6 address."""
    bad = InvalidArgument(f"address: {clip(address)} is not host:port")
    if not isinstance(address, str) or len(address) > 300 or ":" not in address:
        raise bad
    host, _, port = address.rpartition(":")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise bad
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad from None
        return address
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL_RE.fullmatch(x) for x in labels):
        raise bad
    return address


def check_entry(entry: Entry, index: int, max_ttl_s: float) -> Entry:
    where = f"entries[{index}]"
    check_key(entry.key, f"{where}.key")
    if not (0 < entry.position < MAX_EXACT and entry.position % POSITION_ALIGN == 0):
        raise InvalidArgument(
            f"{where}.position: {entry.position} must be a positive multiple of {POSITION_ALIGN}"
        )
    if not 0 < entry.size_bytes < MAX_EXACT:
        raise InvalidArgument(f"{where}.size_bytes: {entry.size_bytes} must be > 0 and < 2**53")
    if entry.ttl_s is not None and not 0 < entry.ttl_s <= max_ttl_s:
        raise InvalidArgument(f"{where}.ttl_s: {entry.ttl_s} must be in (0, {max_ttl_s:g}]")
    return entry


def check_entries(entries: Sequence[Entry], max_batch: int, max_ttl_s: float) -> list[Entry]:
    check_batch(len(entries), max_batch, "entries")
    return [check_entry(e, i, max_ttl_s) for i, e in enumerate(entries)]
