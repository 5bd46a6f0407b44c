"""S3 I/O for shard locations: one boto3 client and one thread pool per location.

`ShardStore` owns the per-location health (`_health`, one `LocationHealth`
each: error rate over a sliding window, latency budget); nothing else records
outcomes in it. boto3 blocks, so each call runs in its location's executor: a
slow or dead location only ties up its own threads. Shard GETs, the hot read
path, skip botocore's per-request Python (~1 ms of GIL each): the location's
boto3 client presigns the URL (cached), and an aiohttp session per location
fetches it on the event loop. Data-path calls on a location that is down
(a high recent error rate) return a miss at once instead of waiting for a
timeout again, apart from one trial read per `location_retry_s`; admin probes
and scrub always really try.

Object name of a shard in its bucket: `blk/<key>` for a single object,
`run/<run id>` for a run (runs.py). `requests` counts the S3 requests sent per
kind (get, range, put, delete, list, head): the kvstore's Stats counters show
them, tests and the benchmark count requests per block with them.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
import yarl
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from kvmesh.s3 import s3_client
from kvmesh.services.kvstore.config import KvstoreConfig, ShardLocation
from kvmesh.services.kvstore.health import HealthPolicy, LocationHealth

log = logging.getLogger("kvmesh.kvstore.shards")
PREFIX = "blk/"
RUN_PREFIX = "run/"
_MISSING = {"NoSuchKey", "404", "NotFound"}
URL_TTL_S = 3600  # presigned GET URLs are valid this long; reused for half of it
URL_CACHE = 8192  # presigned URLs kept per store (LRU)
_SESSION_LOCK = threading.Lock()


def _fast_timestamp(value):
    """botocore's timestamp parser minus dateutil (~1 ms of Python per GetObject
    just for the Last-Modified header): RFC 1123 headers via email.utils, ISO 8601
    (ListObjects) via fromisoformat, anything else via botocore's own parser."""
    if isinstance(value, str):
        try:
            if value[:1].isdigit():
                return datetime.datetime.fromisoformat(value)
            return email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            pass
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)


def shard_client(endpoint: str, connect_timeout: float, read_timeout: float, pool: int):
    """A boto3 S3 client for one location, tuned for many small GETs:

    `kvmesh.s3.s3_client` (one attempt, short
    timeouts, path addressing) plus: no response checksum validation unless the
    operation requires it (every shard carries its own crc32 over all its bytes,
    checked in `ec.parse`; botocore's would hash each body a second time) and a
    dateutil-free timestamp parser. Own botocore session (shared by the kvstore's
    clients) so the parser setting stays private to the kvstore.
    """
    with _SESSION_LOCK:  # creating clients from one boto3 session is not thread-safe
        return s3_client(endpoint, connect_timeout, read_timeout, pool,
                         session=_shard_session(), response_checksum_validation="when_required")


@functools.cache
def _shard_session():
    """One boto3 session for every shard client of the process: the S3 service model
    is loaded once (~0.15-0.5 s per client on the CI box otherwise, 12 per kvstore)."""
    import boto3
    import botocore.session

    core = botocore.session.Session()
    core.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=_fast_timestamp)
    return boto3.Session(botocore_session=core)


class LocationDown(Exception):
    """The location did not answer (connection refused, timeout, 5xx)."""


@dataclass(frozen=True)
class ListedShard:
    key: str
    size: int
    modified: float  # unix seconds, from S3 LastModified


class ShardStore:
    def __init__(self, locations, connect_timeout: float = 1.0, read_timeout: float = 5.0,
                 retry_s: float = 2.0, threads: int = 4, policy: HealthPolicy | None = None):
        self.locations: tuple[ShardLocation, ...] = tuple(locations)
        self.policy = policy or HealthPolicy(retry_s=retry_s, ceiling_s=read_timeout)
        self._clients = [shard_client(loc.endpoint, connect_timeout, read_timeout, max(threads, 4))
                         for loc in self.locations]
        self._pools = [ThreadPoolExecutor(threads, thread_name_prefix=f"s3-{i}")
                       for i in range(len(self.locations))]
        self._health = [LocationHealth(self.policy) for _ in self.locations]
        self._inflight: list[dict[object, float]] = [{} for _ in self.locations]  # start times
        self._conn_limit = max(threads, 4)
        self._http_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                                   sock_read=read_timeout)
        # Per location: (loop, session); a session belongs to the loop it was made on.
        self._sessions: list[tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None] = \
            [None] * len(self.locations)
        self._urls: OrderedDict[tuple[int, str], tuple[float, str]] = OrderedDict()
        self.requests: Counter[str] = Counter()  # S3 requests sent, by kind

    @classmethod
    def from_config(cls, cfg: KvstoreConfig) -> ShardStore:
        return cls(cfg.locations, cfg.s3_connect_timeout_s, cfg.s3_read_timeout_s,
                   cfg.location_retry_s, cfg.threads_per_location, cfg.health_policy())

    async def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()
        for i, held in enumerate(self._sessions):
            if held is not None and held[0] is loop:
                await held[1].close()
            self._sessions[i] = None

    # -- health -----------------------------------------------------------------
    def is_up(self, i: int) -> bool:
        return not self._health[i].down(time.monotonic())

    def up_count(self) -> int:
        return sum(self.is_up(i) for i in range(len(self.locations)))

    def readable(self, i: int) -> bool:
        """May the data path read location i now? Up, or down with a trial due."""
        now = time.monotonic()
        health = self._health[i]
        return not health.down(now) or health.claim_trial(now)

    def budget(self, i: int) -> float:
        """Seconds after which a shard read from location i is late (hedge then)."""
        return self._health[i].budget()

    def slow(self, i: int) -> bool:
        """Is a read from location i in flight for longer than its budget right now?
        Readers then prefer other shards to it (it may be hung)."""
        now = time.monotonic()
        budget = self.budget(i)
        return any(now - t0 > budget for t0 in self._inflight[i].values())

    def error_rate(self, i: int) -> tuple[int, float]:
        return self._health[i].error_rate(time.monotonic())

    def _mark(self, i: int, ok: bool, latency: float | None = None,
              refused: bool = False) -> None:
        now = time.monotonic()
        health = self._health[i]
        was_down = health.down(now)
        health.record(now, ok, latency, refused)
        if health.down(now) != was_down:
            errors, rate = health.error_rate(now)
            if was_down:
                log.warning("shard location %d (%s) is up again", i, self.locations[i])
            else:
                log.warning("shard location %d (%s) is down: %d errors, %.0f%% of recent "
                            "requests", i, self.locations[i], errors, 100 * rate)

    async def _call(self, i: int, fn, *args, force: bool = False, **kw):
        """Run a boto3 call for location i; LocationDown if it did not answer."""
        if not force and not self.is_up(i):
            raise LocationDown(str(self.locations[i]))
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._pools[i], lambda: fn(*args, **kw))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _MISSING or status == 404:
                self._mark(i, True)
                raise KeyError(code) from None
            if status >= 500:
                self._mark(i, False)
                raise LocationDown(f"{self.locations[i]}: {code}") from exc
            raise
        except (BotoCoreError, OSError) as exc:
            self._mark(i, False, refused=isinstance(exc, EndpointConnectionError))
            raise LocationDown(f"{self.locations[i]}: {exc}") from exc
        self._mark(i, True)
        return result

    async def probe(self) -> list[bool]:
        """Really ask every location (HEAD bucket); updates the health marks."""
        async def one(i: int) -> bool:
            try:
                await self._call(i, self._clients[i].head_bucket,
                                 Bucket=self.locations[i].bucket, force=True)
                return True
            except (LocationDown, KeyError, ClientError):
                return False

        return list(await asyncio.gather(*(one(i) for i in range(len(self.locations)))))

    # -- objects ----------------------------------------------------------------
    async def put(self, i: int, key: str, blob: bytes, force: bool = False,
                  prefix: str = PREFIX) -> bool:
        """Store one shard; False when it did not land. `force`: try a down location too."""
        self.requests["put"] += 1
        try:
            await self._call(i, self._clients[i].put_object,
                             Bucket=self.locations[i].bucket, Key=prefix + key, Body=blob,
                             force=force)
            return True
        except (LocationDown, KeyError, ClientError) as exc:
            log.debug("put shard %d of %s failed: %s", i, key, exc)
            return False

    def _session(self, i: int) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        held = self._sessions[i]
        if held is None or held[0] is not loop or held[1].closed:
            connector = aiohttp.TCPConnector(limit=self._conn_limit, ttl_dns_cache=None)
            session = aiohttp.ClientSession(connector=connector, timeout=self._http_timeout,
                                            auto_decompress=False, skip_auto_headers=("User-Agent",))
            held = self._sessions[i] = (loop, session)
        return held[1]

    def _get_url(self, i: int, name: str) -> str:
        """A presigned GET URL for object `name` at location i, signed by its boto3 client.
        (A Range header is not part of the signature: one URL serves ranged reads too.)"""
        now = time.monotonic()
        cached = self._urls.get((i, name))
        if cached is not None and now - cached[0] < URL_TTL_S / 2:
            self._urls.move_to_end((i, name))
            return cached[1]
        url = self._clients[i].generate_presigned_url(
            "get_object", Params={"Bucket": self.locations[i].bucket, "Key": name},
            ExpiresIn=URL_TTL_S)
        self._urls[(i, name)] = (now, url)
        self._urls.move_to_end((i, name))
        while len(self._urls) > URL_CACHE:
            self._urls.popitem(last=False)
        return url

    async def get(self, i: int, key: str, force: bool = False, prefix: str = PREFIX,
                  byte_range: tuple[int, int] | None = None) -> bytes | None:
        """The shard's bytes, or None when absent or the location is down.

        Same outcomes and health records as a boto3 get_object through `_call`:
        404 -> None (a success), 5xx / no answer -> None (an error), other
        errors -> None (not recorded). `force`: read even if the location is down.
        `byte_range` (start, end): only bytes [start, end) (an HTTP Range GET);
        a short answer is None."""
        if not force and not self.is_up(i):
            return None
        self.requests["range" if byte_range else "get"] += 1
        t0 = time.monotonic()
        token = object()
        self._inflight[i][token] = t0
        try:
            return await self._get(i, prefix + key, t0, byte_range)
        finally:
            del self._inflight[i][token]

    async def _get(self, i: int, name: str, t0: float,
                   byte_range: tuple[int, int] | None = None) -> bytes | None:
        try:
            url = self._get_url(i, name)
        except BotoCoreError as exc:  # local signing failed; says nothing about the location
            log.debug("get shard %d of %s: presign failed: %s", i, name, exc)
            return None
        headers = None
        if byte_range is not None:
            headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}
        try:
            async with self._session(i).get(yarl.URL(url, encoded=True), headers=headers) as resp:
                status = resp.status
                body = await resp.read() if status in (200, 206) else b""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._mark(i, False, refused=isinstance(exc, aiohttp.ClientConnectorError))
            log.debug("get shard %d of %s: location down: %s", i, name, exc)
            return None
        if byte_range is not None and status in (200, 206):
            self._mark(i, True)  # a partial read's latency is not a shard read's: no budget
            if status == 200:  # the server ignored the range
                body = body[byte_range[0]:byte_range[1]]
            return body if len(body) == byte_range[1] - byte_range[0] else None
        if status == 200:
            self._mark(i, True, time.monotonic() - t0)
            return body
        if status == 404:
            self._mark(i, True)
        elif status >= 500:
            self._mark(i, False)
        if status != 404:
            log.debug("get shard %d of %s: HTTP %d", i, name, status)
        return None

    async def delete(self, i: int, key: str, force: bool = False, prefix: str = PREFIX) -> bool:
        self.requests["delete"] += 1
        try:
            await self._call(i, self._clients[i].delete_object,
                             Bucket=self.locations[i].bucket, Key=prefix + key, force=force)
            return True
        except KeyError:
            return True
        except (LocationDown, ClientError):
            return False

    async def list(self, i: int, prefix: str = PREFIX) -> list[ListedShard]:
        """Every shard object at location i (under `prefix`). Raises LocationDown."""
        def walk():
            out, token = [], None
            client, bucket = self._clients[i], self.locations[i].bucket
            while True:
                kw = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
                if token:
                    kw["ContinuationToken"] = token
                self.requests["list"] += 1
                resp = client.list_objects_v2(**kw)
                for obj in resp.get("Contents", []):
                    out.append(ListedShard(obj["Key"][len(prefix):], obj["Size"],
                                           obj["LastModified"].timestamp()))
                if not resp.get("IsTruncated"):
                    return out
                token = resp["NextContinuationToken"]

        try:
            return await self._call(i, walk, force=True)
        except (KeyError, ClientError) as exc:
            raise LocationDown(f"{self.locations[i]}: {exc}") from exc
