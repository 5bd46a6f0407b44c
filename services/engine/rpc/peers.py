"""Snapshot transfer between engines: serving side and fetching side.

A snapshot travels as a gRPC stream of <= 1 MiB chunks; the first message has
the header, the last the sha256 of the data. The fetcher checks everything
before the bytes can reach a slot: size, digest, layout and model fingerprints,
position. Any failure (peer down, slow, corrupt, foreign layout) is a miss.
"""

from __future__ import annotations

import hashlib
import re
import time

import grpc

from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import channel
from kvmesh.services.engine.cache.snapshots import Snapshot

CHUNK = 1 << 20
KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def check_key(key: str) -> None:
    if not KEY_RE.match(key):
        raise InvalidArgument(f"snapshot key must be 64 lowercase hex characters, got {key[:80]!r}")


def snapshot_messages(snap: Snapshot | None, key: str):
    """The response stream for one snapshot (raises NotFound when absent)."""
    if snap is None:
        raise NotFound(f"snapshot {key} is not held by this engine")
    data = snap.data
    yield engine_pb2.FetchSwaSnapshotResponse(
        position=snap.position, layout_fingerprint=snap.layout_fp,
        model_fingerprint=snap.model_fp, total_bytes=len(data))
    yield from body_messages(data, engine_pb2.FetchSwaSnapshotResponse)


def body_messages(data: bytes, response):
    """The body of a checked transfer (snapshots, handoffs): `data` in <= CHUNK pieces, then
    its sha256; `response` is the stream's message class."""
    for off in range(0, len(data), CHUNK):
        yield response(data=data[off : off + CHUNK])
    yield response(sha256=hashlib.sha256(data).hexdigest())


class FetchError(Exception):
    pass


async def read_transfer(stream, limit: int | None = None):
    """Read a transfer stream (header message | data ... | sha256) -> (first message, data,
    sha256 sent). FetchError for an RPC failure, an empty stream, or more than `limit` bytes
    of data (read no further than was announced)."""
    first, parts, got, digest = None, [], 0, ""
    try:
        async for msg in stream:
            if first is None:
                first = msg
            elif msg.sha256:
                digest = msg.sha256
            else:
                got += len(msg.data)
                if limit is not None and got > limit:
                    raise FetchError(f"sends more than {limit} B")
                parts.append(msg.data)
    except grpc.aio.AioRpcError as exc:
        raise FetchError(f"{exc.code().name} {exc.details()}") from None
    if first is None:
        raise FetchError("empty stream")
    return first, b"".join(parts), digest


async def fetch_snapshot(address: str, key: str, timeout_s: float, expect_layout: str,
                         expect_model: str, expect_size: int, expect_position: int
                         ) -> tuple[Snapshot, float]:
    """Fetch and verify; returns (snapshot, seconds). Raises FetchError on any problem."""
    t0 = time.perf_counter()
    async with channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        try:
            header, data, digest = await read_transfer(stub.FetchSwaSnapshot(
                engine_pb2.FetchSwaSnapshotRequest(key=key), timeout=timeout_s))
        except FetchError as exc:
            raise FetchError(f"{address}: {exc}") from None
    problems = []
    if header.layout_fingerprint != expect_layout or header.model_fingerprint != expect_model:
        problems.append("layout or model fingerprint differs")
    if len(data) != header.total_bytes or len(data) != expect_size:
        problems.append(f"size {len(data)} != {expect_size}")
    if hashlib.sha256(data).hexdigest() != digest:
        problems.append("sha256 mismatch")
    if header.position != expect_position:
        problems.append(f"position {header.position} != {expect_position}")
    if problems:
        raise FetchError(f"{address}: snapshot {key[:12]} refused: " + "; ".join(problems))
    snap = Snapshot(key, header.position, header.layout_fingerprint, header.model_fingerprint,
                    data, time.monotonic())
    return snap, time.perf_counter() - t0
