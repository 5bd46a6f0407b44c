"""GatewayCore: validate, route, call an engine, retry before the first token. No gRPC here.

One request (see README.md for the walk-through):

    check_request -> tokenize -> snapshot keys of the prefix -> directory Lookup
    -> Router.pick -> EnginePool.stream -> yield chunks ...
       engine fails before any token: mark it down, pick another (max_attempts)
       engine fails after N tokens:   continue on another engine from prompt + the N tokens
                                      (migration_limit times), then
                                      Unavailable("engine X failed mid-stream after N tokens")

The core owns the `Router` (engine table + affinity map) and the cached model
info; all of it is touched only from the event loop the core runs on. The
engine pool and directory client are injected, so tests can swap them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from kvmesh import cachekeys
from kvmesh.auth import ApiKeys, Principal, tenant_request_id, tenant_salt
from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.metrics import RequestMetrics
from kvmesh.services.gateway import validate
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.engines import EnginePool, engine_request, resume_request
from kvmesh.services.gateway.model import (
    HTTP_METHODS,
    HTTP_STATUS,
    Chunk,
    DeadlineExceeded,
    EngineFailure,
    GenRequest,
    Usage,
    http_status,
    status_name,
)
from kvmesh.services.gateway.pd import PdFailed, PdRoutes, serve_pd
from kvmesh.services.gateway.router import Router
from kvmesh.tokenizer import load_tokenizer

log = logging.getLogger("kvmesh.gateway")
# Lookup batches stay well under the directory's limit (4096); the deepest keys matter most.
MAX_LOOKUP_KEYS = 1024


class ModelInfo:
    """What routing needs from an engine's GetModelInfo (all engines serve one model).

    The model config arrives as JSON and is read as plain fields: the gateway names cache
    contents with kvmesh.cachekeys and never imports the engine's model config."""

    def __init__(self, msg):
        cfg = json.loads(msg.model_config_json)
        self.layout_fp: str = msg.layout_fingerprint
        self.served_fp: str = msg.model_fingerprint      # what engines' identities must match
        self.vocab_size: int = cfg["vocab_size"]
        self.block_size: int = cfg["block_size"]
        self.window: int = cfg["window"]
        self.name: str = cfg["name"]                    # the served model id (HTTP API)
        self.max_seq_len: int = cfg["max_seq_len"]
        # Part of every block hash; computing it costs more than hashing a short prompt.
        self.model_fp = cachekeys.model_fingerprint(cfg)

    def snapshot_keys(self, ids, salt: str) -> list[str]:
        """Snapshot keys of every block boundary, shortest prefix first (as
        `prefix_snapshot_keys`, with the model fingerprint computed once)."""
        if len(ids) < self.block_size:  # no complete block: nothing to hash
            return []
        return [cachekeys.snapshot_key(h, self.layout_fp)
                for h in cachekeys.chain(ids, self.block_size, self.model_fp, salt)]

    def lookup_count(self, n_tokens: int) -> int:
        """How many leading keys can name a usable snapshot. An engine restores one only at
        a block boundary <= prompt - KEEP, and KEEP >= W + B >= W (the window), so keys past
        prompt - W can never be a hit: the directory is not asked about them."""
        return max(0, n_tokens - self.window) // self.block_size


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, pool: EnginePool | None = None, directory=None,
                 clock=time.monotonic):
        self.cfg = cfg
        self.pool = pool or EnginePool(session=cfg.engine_sessions)
        self.directory = directory          # DirectoryClient-like, or None
        self.clock = clock
        self.router = Router(cfg.engine_list, cfg.affinity_entries, cfg.max_imbalance)
        self.pd = PdRoutes.from_config(cfg)     # prefill/decode engines, None = off
        self.tokenizer = load_tokenizer(cfg.tokenizer or None)
        self.metrics = RequestMetrics("gateway")
        # None = auth off (no keys file): every caller is anonymous, as before keys existed.
        self.keys = ApiKeys.load(cfg.api_keys) if cfg.api_keys else None
        self.info: ModelInfo | None = None
        self._info_retry_at = 0.0
        self._dir_down_until = 0.0
        self._refresher: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh_engines()
        self._refresher = asyncio.create_task(self._refresh_loop())
        await self.model_info()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self.pool.close()
        if self.directory is not None:
            await self.directory.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_s)
            await self.refresh_engines()

    async def refresh_engines(self) -> None:
        """One ListEngines (on failure engines keep their leases and lapse on their own),
        then every engine's connection looked at: an engine whose process died refuses
        connections, and leaves the candidates within a refresh or two instead of when its
        lease lapses (a static engine's never does)."""
        if self.directory is not None:
            try:
                engines = await self.directory.list_engines(timeout=max(self.cfg.refresh_s, 0.5))
            except KvmeshError as exc:
                log.warning("directory ListEngines failed: %s", exc)
                engines = []
            self.router.update_from_directory(engines, self.clock())
            if self.pd is not None:
                self.pd.update_from_directory(engines, self.clock())
        routers = [self.router] + ([self.pd.prefill, self.pd.decode] if self.pd else [])
        for st in (st for r in routers for st in r.engines.values()):
            reachable = self.pool.connectable(st.address)
            if reachable == st.unreachable:
                log.warning("engine %s (%s) is %s", st.engine_id, st.address,
                            "reachable again" if reachable else "unreachable: refused connection")
            st.unreachable = not reachable

    async def model_info(self) -> ModelInfo | None:
        """GetModelInfo from the first engine that answers; cached once known."""
        if self.info is not None or self.clock() < self._info_retry_at:
            return self.info
        for st in self.router.candidates(self.clock()):
            try:
                self.info = ModelInfo(await self.pool.model_info(st.address))
                return self.info
            except (KvmeshError, ValueError) as exc:
                log.warning("GetModelInfo from %s failed: %s", st.address, exc)
        self._info_retry_at = self.clock() + self.cfg.down_s
        return None

    async def check_identity(self, st) -> None:
        """Before a request goes to an engine not seen since it was added or since it failed:
        its GetModelInfo must answer the identity first recorded for that address (engine
        id, model fingerprint) and the model this gateway serves. Another process on a dead
        engine's port (a restarted engine of another model, or anything else that took the
        port) is refused, and stays refused until the directory registers that address
        again under a new engine id. Raises EngineFailure (no prompt was sent)."""
        if st.checked:
            return
        try:
            msg = await self.pool.model_info(st.address)
        except KvmeshError as exc:
            raise EngineFailure(f"{st.address} did not say who it is: {exc}") from None
        seen = (msg.engine_id, msg.model_fingerprint)
        info = await self.model_info()
        if st.identity is None and (info is None or seen[1] == info.served_fp):
            st.identity = seen
            if st.engine_id == st.address:         # a static engine: now known by its name
                st.engine_id = seen[0] or st.engine_id
        if seen != st.identity:
            st.refused = True
            want = st.identity or ("any id", info.served_fp if info else "?")
            log.warning("engine at %s answers as %r, model %s; expected %r, model %s: refused "
                        "until it registers again", st.address, seen[0], seen[1][:12],
                        want[0], want[1][:12])
            raise EngineFailure(f"engine at {st.address} is not the engine registered there "
                                f"(answers as {seen[0]!r}, model {seen[1][:12]})")
        st.checked = True

    # --- routing inputs -----------------------------------------------------------------
    def prompt_ids(self, req: GenRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        ids = self.tokenizer.encode(req.prompt)
        validate.check_prompt_tokens(len(ids), self.cfg)
        return ids

    async def holders(self, keys: list[str]) -> dict:
        """Directory Lookup of the snapshot keys; {} when there is no or a failing directory."""
        if not keys or self.directory is None or self.clock() < self._dir_down_until:
            return {}
        try:
            return await self.directory.lookup(keys[-MAX_LOOKUP_KEYS:],
                                               timeout=self.cfg.directory_timeout_s)
        except KvmeshError as exc:
            # Routing without snapshots is still correct: back off instead of paying
            # the timeout on every request while the directory is down.
            self._dir_down_until = self.clock() + self.cfg.down_s
            log.warning("directory Lookup failed, routing by affinity/load for %.1fs: %s",
                        self.cfg.down_s, exc)
            return {}

    # --- requests -----------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller's principal from its `authorization` value; None when auth is off.
        Raises Unauthenticated for a missing or unknown key (gRPC and HTTP share this)."""
        if self.keys is None:
            return None
        return self.keys.authenticate(authorization)

    def open(self, req: GenRequest, timeout: float | None = None, method: str = "stream",
             principal: Principal | None = None) -> GatewayRequest:
        return GatewayRequest(self, req, timeout, method, principal)

    def refused(self, method: str, exc: KvmeshError, total_s: float, where: str = "") -> None:
        """Count and log a request refused before `open` (bad key, a body or message over
        the size limit, unparsable fields): the same metric and log line as the others,
        so a 5 MiB request shows up like any refused request. `where`: e.g. " http=413"."""
        status = status_name(exc)
        label = str(http_status(exc)) if method in HTTP_METHODS else status
        self.metrics.observe(method, label, total_s)
        log.info("request id=- status=%s%s method=%s: %s", status, where, method, exc)


class GatewayRequest:
    """One request's life: iterate it for chunks; `engine_id`, `attempts` are set as it goes.

    Owned by the servicer call that opened it; it changes router state only
    through `Router` methods (in-flight counts, marks, affinity).
    """

    def __init__(self, core: GatewayCore, req: GenRequest, timeout: float | None, method: str,
                 principal: Principal | None = None):
        self.core = core
        # `req` keeps the client's own id (what the client sees back); the engine gets the
        # tenant-scoped id and salt (`scoped`), so tenants share neither ids nor cache.
        self.req = req if req.request_id else replace(req, request_id=uuid.uuid4().hex)
        self.tenant = principal.tenant if principal is not None else None
        self.deadline = None if timeout is None else core.clock() + timeout
        self.method = method
        self.error: KvmeshError | None = None     # what ended it, if an error did
        self.engine_id = ""
        self.attempts = 0
        self.migrations = 0
        self.generated: list[int] = []   # every token sent so far: a migration resumes from them
        self.route = ""
        self.usage = Usage()
        self.t0 = core.clock()
        self.ttft: float | None = None
        self.prefill_engine = ""         # disaggregated (pd.py): the engines of each phase
        self.decode_engine = ""

    @property
    def tokens(self) -> int:
        """Tokens sent to the client so far."""
        return len(self.generated)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._run()

    async def _run(self) -> AsyncIterator[Chunk]:
        status = "UNKNOWN"
        self.core.metrics.in_flight.inc()
        try:
            async for chunk in self._serve():
                yield chunk
            status = "OK"
        except KvmeshError as exc:
            status, self.error = status_name(exc), exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            self.core.metrics.in_flight.dec()
            self._finish(status)

    async def _serve(self) -> AsyncIterator[Chunk]:
        core, req = self.core, self.req
        info = await core.model_info()
        validate.check_request(req, core.cfg, info.vocab_size if info else None)
        req = self.scoped()
        ids = core.prompt_ids(req)
        keys: list[str] = []
        holders: dict = {}
        if info is not None:
            # Every block-boundary key feeds the affinity map; only those that can still
            # be a snapshot hit go to the directory (none for short prompts: no Lookup).
            keys = info.snapshot_keys(ids, req.cache_salt)
            holders = await core.holders(keys[:info.lookup_count(len(ids))])
        msg = engine_request(req)
        if (core.cfg.migration_limit or core.pd) and not msg.sampling.HasField("seed"):
            # A stream continued on another engine draws its next tokens from the same
            # (seed, position) stream only if the seed is known here.
            msg.sampling.seed = random.getrandbits(62)
        if core.pd is not None:
            try:
                async with contextlib.aclosing(serve_pd(self, msg, keys, holders)) as chunks:
                    async for chunk in chunks:
                        self._took(chunk)
                        yield chunk
                return
            except PdFailed as exc:
                # a unified engine takes over, from the tokens already sent (same seed)
                log.warning("request %s: disaggregation failed after %d tokens (%s); "
                            "falling back to a unified engine", req.request_id, self.tokens, exc)
                core.metrics.retries.inc()
                if self.generated:
                    msg = resume_request(msg, ids, self.generated)
        failed_at: dict[str, float] = {}   # engine address -> when it failed this request
        last: Exception | None = None
        while self.attempts < core.cfg.max_attempts + self.migrations:
            # An engine that failed this request is avoided while it is marked down, not for
            # the request's whole life: a long request (queued, then migrated) may need an
            # engine that failed a minute ago and has restarted since. `max_attempts` and
            # `migration_limit` bound the loop.
            now = core.clock()
            avoid = [a for a, t in failed_at.items() if now - t < core.cfg.down_s]
            choice = core.router.pick(now, keys, holders, exclude=avoid)
            if choice is None:
                break
            st = choice.engine
            self.engine_id, self.route = st.engine_id, choice.reason
            self.attempts += 1
            if self.attempts > 1:
                core.metrics.retries.inc()
            st.in_flight += 1
            sent_before = self.tokens
            try:
                await core.check_identity(st)
                async with contextlib.aclosing(
                        core.pool.stream(st.address, msg, self._remaining())) as chunks:
                    async for chunk in chunks:
                        self._took(chunk)
                        yield chunk
            except EngineFailure as exc:
                core.router.mark_down(st.address, core.clock() + core.cfg.down_s)
                # tokens from this engine: a migration; none (even after a disaggregated
                # request's first tokens, or a migration): another try of the same request
                if self.tokens > sent_before:
                    if self.migrations >= core.cfg.migration_limit:
                        raise Unavailable(f"engine {st.engine_id} failed mid-stream after "
                                          f"{self.tokens} tokens: {exc}") from None
                    msg = resume_request(msg, ids, self.generated)
                    self.migrations += 1
                    core.metrics.migrations.inc()
                    log.warning("request %s: engine %s failed after %d tokens (%s); continuing "
                                "on another engine", req.request_id, st.engine_id, self.tokens, exc)
                else:
                    log.warning("request %s: engine %s failed before the first token (%s); "
                                "retrying", req.request_id, st.engine_id, exc)
                failed_at[st.address] = core.clock()
                last = exc
                continue
            finally:
                st.in_flight -= 1
            core.router.mark_up(st.address)
            core.router.remember(keys, st.address)
            return
        if last is None:
            raise Unavailable("no engine available: none configured or none alive")
        raise Unavailable(f"no engine could serve the request after {self.attempts} attempts; "
                          f"last error from {self.engine_id}: {last}")

    def _took(self, chunk: Chunk) -> None:
        """Bookkeeping of a chunk on its way to the client."""
        if self.ttft is None and chunk.token_ids:
            self.ttft = self.core.clock() - self.t0
        self.generated.extend(chunk.token_ids)
        if chunk.usage is not None:
            self.usage = chunk.usage

    def scoped(self) -> GenRequest:
        """The request as engines see it: id and cache salt inside the caller's tenant."""
        if self.tenant is None:
            return self.req
        return replace(self.req, request_id=tenant_request_id(self.tenant, self.req.request_id),
                       cache_salt=tenant_salt(self.tenant, self.req.cache_salt))

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - self.core.clock()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded before an engine was called")
        return left

    def _finish(self, status: str) -> None:
        """Metrics and the request's log line, after the answer is on its way.

        Both are deferred to the next turn of the event loop: the servicer hands the
        last message (or the unary response) to grpc first, so neither sits on the
        request's latency. Values are taken now; the deferral only moves the work.
        """
        total = self.core.clock() - self.t0
        args = (status, total, self.ttft, self.usage, self.tokens)
        try:
            asyncio.get_running_loop().call_soon(self._report, *args)
        except RuntimeError:  # no running loop (generator closed outside it): report now
            self._report(*args)

    def _report(self, status: str, total: float, ttft: float | None, u: Usage,
                generated: int) -> None:
        label = status
        if self.method in HTTP_METHODS:       # the HTTP API's requests: by HTTP status
            label = str(http_status(self.error) if self.error else HTTP_STATUS.get(status, 500))
        self.core.metrics.observe(self.method, label, total, ttft, dict(
            prompt=u.prompt_tokens, cached=u.cached_tokens, replayed=u.replayed_tokens,
            generated=generated))
        log.info("request id=%s status=%s engine=%s route=%s attempts=%d prompt=%d cached=%d "
                 "replayed=%d generated=%d ttft_ms=%s total_ms=%.1f", self.req.request_id,
                 status, self.engine_id or "-", self.route or "-", self.attempts,
                 u.prompt_tokens, u.cached_tokens, u.replayed_tokens, generated,
                 "-" if ttft is None else f"{ttft * 1000:.1f}", total * 1000)
