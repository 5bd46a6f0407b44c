"""Starlette app: the OpenAI-compatible routes over a running `GatewayCore`.

    POST /v1/completions        text or token-id prompt -> text_completion (or SSE chunks)
    POST /v1/chat/completions   messages -> chat template -> chat.completion (or SSE chunks)
    GET  /v1/models[/{id}]      the one model the engines serve (id = the preset's name)
    POST /tokenize, /detokenize  vLLM's tokenizer routes (tokenize.py); GET /version
    GET  /health                200 while an engine is routable, else 503
    GET  /metrics               Prometheus text: the same registry as the gateway's --metrics-port

With an API keys file, generation and model routes need `Authorization: Bearer <key>`
(401 in OpenAI's error shape otherwise; `core.authenticate` is the check gRPC uses too);
/health and /metrics stay open for probes and scrapers.

Every generation goes through `core.open` (validation, routing, retries, migration,
metrics, the request log line), as a gRPC call does. A request refused before it
reaches the core (body too large, not JSON, bad field, unknown model) is counted in
`kvmesh_requests_total` and logged here, the same way.

Client disconnects: each generation response watches the ASGI `receive` channel;
`http.disconnect` before the response is complete cancels the handler's task, and the
CancelledError unwinds through `GatewayRequest` into the engine session, which cancels
the engine's tag (slot and blocks freed), as a cancelled gRPC call does.

All state is the core's; the app holds only the chat template and owns nothing mutable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.errors import KvmeshError, TooLarge, Unavailable
from kvmesh.services.gateway.core import GatewayCore
from kvmesh.services.gateway.openai_api import fields, tokenize
from kvmesh.services.gateway.openai_api.chat import load_template
from kvmesh.services.gateway.openai_api.render import (
    DONE,
    Logprobs,
    ModelNotFound,
    Renderer,
    error_body,
    http_error,
    sse,
    total_usage,
)

log = logging.getLogger("kvmesh.gateway.http")
JSON_HEADERS = [(b"content-type", b"application/json")]
IGNORED_HEADER = b"x-kvmesh-ignored-fields"   # request fields this API ignored (--strict-fields: 400)
# A body over the limit is read to its end (and dropped) up to this multiple of the limit.
DRAIN_FACTOR = 16
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def choices(req, n: int) -> list:
    """The n requests of `n` choices: with a seed, choice i samples with seed + i (so they
    differ and are reproducible); without one each draws its own."""
    if n == 1:
        return [req]
    return [replace(req, seed=None if req.seed is None else (req.seed + i) % 2**63)
            for i in range(n)]


def error_response(exc: BaseException) -> JSONResponse:
    status, body = http_error(exc)
    return JSONResponse(body, status_code=status)


class Generation:
    """ASGI response for one request's generations (`n` choices, each its own gateway
    request): runs them in the handler's task and cancels that task if the client
    disconnects first (so the engines free every choice's slot)."""

    def __init__(self, app: OpenAIApp, grs: list, renderer: Renderer, stream: bool,
                 ignored: tuple[str, ...] = ()):
        self.app, self.grs, self.r, self.stream = app, grs, renderer, stream
        # unknown request fields, ignored: named back to the client, as a warning
        self.headers = [(IGNORED_HEADER, ",".join(ignored).encode())] if ignored else []
        self.gr = grs[0]           # the response's id and log lines are the first choice's
        self.complete = False
        self.gone = False

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            if not self.complete:
                self.gone = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await (self._stream(send) if self.stream else self._unary(send))
        except asyncio.CancelledError:
            if not self.gone:
                raise
            log.info("request id=%s: client disconnected; generation cancelled",
                     self.gr.req.request_id)
        finally:
            watcher.cancel()

    async def _start(self, send, status: int, headers) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, *self.headers,
                                (b"x-request-id", self.gr.req.request_id.encode())]})

    async def _body(self, send, body: bytes, more: bool = False) -> None:
        if not more:
            self.complete = True
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _error(self, send, exc: Exception) -> None:
        """The whole response is this error (nothing was sent yet)."""
        if not isinstance(exc, KvmeshError):
            log.exception("internal error in HTTP handler (request %s)", self.gr.req.request_id)
        status, body = http_error(exc)
        await self._start(send, status, JSON_HEADERS)
        await self._body(send, json.dumps(body).encode())

    async def _unary(self, send) -> None:
        async def collect(gr) -> tuple[str, str | None, list]:
            parts, finish, pairs = [], None, []
            async for c in gr:
                parts.append(c.text)
                finish = c.finish or finish
                pairs += _pairs(c)
            return "".join(parts), finish, pairs
        try:
            results = await asyncio.gather(*map(collect, self.grs))
        except Exception as exc:  # noqa: BLE001 - mapped to a status, 500 if unknown
            await self._error(send, exc)
            return
        out = self.r.full(results, total_usage([gr.usage for gr in self.grs]))
        await self._start(send, 200, JSON_HEADERS)
        await self._body(send, json.dumps(out, separators=(",", ":")).encode())

    async def _stream(self, send) -> None:
        # aclosing: whatever ends this handler early, every generation is closed here (and
        # its engine tag cancelled), not whenever the garbage collector gets to it.
        async with contextlib.AsyncExitStack() as stack:
            its = [await stack.enter_async_context(contextlib.aclosing(aiter(gr)))
                   for gr in self.grs]
            try:
                # The status goes out with the first events: errors found before them
                # (validation, no engine) are plain HTTP errors, not a 200 that fails.
                firsts = await asyncio.gather(*map(anext, its))
            except Exception as exc:  # noqa: BLE001 - mapped to a status, 500 if unknown
                await self._error(send, exc)
                return
            await self._start(send, 200, SSE_HEADERS)
            for index, first in enumerate(firsts):
                await self._body(send, self.r.chunk(first.text, first.finish, True, index,
                                                    _pairs(first)), more=True)
            try:
                async for index, c in _merged(its):
                    if c.text or c.finish is not None or c.logprobs:
                        await self._body(send, self.r.chunk(c.text, c.finish, index=index,
                                                            pairs=_pairs(c)), more=True)
            except Exception as exc:  # noqa: BLE001 - after the 200: an error event, as OpenAI
                if not isinstance(exc, KvmeshError):
                    log.exception("internal error mid-stream (request %s)",
                                  self.gr.req.request_id)
                await self._body(send, sse(http_error(exc)[1]), more=True)
            else:
                if self.r.include_usage:
                    usage = total_usage([gr.usage for gr in self.grs])
                    await self._body(send, self.r.usage_chunk(usage), more=True)
        await self._body(send, DONE)


def _pairs(c) -> list:
    """A chunk's (token id, TokenLogprob) pairs (none unless the request asked)."""
    return list(zip(c.token_ids, c.logprobs, strict=True)) if c.logprobs else []


async def _merged(its: list):
    """(index, chunk) from several chunk iterators as each arrives, until all are done."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(its)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.get):
                i = pending.pop(fut)
                try:
                    chunk = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, chunk
                pending[asyncio.ensure_future(anext(its[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()


class OpenAIApp:
    """Routes bound to one core. `app` is the ASGI application to serve."""

    def __init__(self, core: GatewayCore):
        self.core = core
        self.template = load_template(core.cfg.tokenizer)
        self.max_body = core.cfg.max_request_bytes
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_exception})

    # --- generation -----------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._generate(request, "http_completions", chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, "http_chat_completions", chat=True)

    async def _generate(self, request: Request, method: str, chat: bool):
        t0 = time.monotonic()
        try:
            # Before the body is read: an unauthenticated caller costs no parsing.
            principal = self.core.authenticate(request.headers.get("authorization"))
            body = await self._json_body(request)
            strict = self.core.cfg.strict_fields
            req, opts = (fields.chat_request(body, self.template, strict) if chat
                         else fields.completion_request(body, strict))
            await self._model_id(opts.model)
        except KvmeshError as exc:
            return self._refused(method, exc, t0)
        except ClientDisconnect:  # gone while sending the body: nobody to answer
            return Response(status_code=499)
        grs = [self.core.open(choice, None, method, principal) for choice in choices(req, opts.n)]
        echo = "" if not opts.echo else req.prompt if req.prompt is not None else \
            self.core.tokenizer.decode(req.prompt_token_ids)
        lps = None if req.logprobs is None else Logprobs(self.core.tokenizer.token_bytes)
        r = Renderer(chat, grs[0].req.request_id, opts.model, opts.include_usage, echo, lps)
        if opts.ignored:
            log.warning("request id=%s: fields ignored (not part of this API): %s",
                        grs[0].req.request_id, ", ".join(opts.ignored))
        return Generation(self, grs, r, opts.stream, opts.ignored)

    async def _json_body(self, request: Request):
        chunks, n = [], 0
        body = request.stream()
        async for chunk in body:
            n += len(chunk)
            if n > self.max_body:
                # Read (and drop) the rest before answering, up to DRAIN_FACTOR x the limit:
                # a client still sending when the server closes gets a reset, not the 413.
                async for more in body:
                    n += len(more)
                    if n > DRAIN_FACTOR * self.max_body:
                        break
                raise TooLarge(f"request body is over {self.max_body} bytes (the limit)")
            chunks.append(chunk)
        return fields.parse_body(b"".join(chunks))

    def _refused(self, method: str, exc: KvmeshError, t0: float) -> JSONResponse:
        """Count and log a request the core never saw, like the core does its own."""
        resp = error_response(exc)
        self.core.refused(method, exc, time.monotonic() - t0, f" http={resp.status_code}")
        return resp

    # --- models and health ----------------------------------------------------------------
    async def _model_id(self, wanted: str | None = None) -> str:
        info = await self.core.model_info()
        if info is None:
            raise Unavailable("no engine available: the model is not known yet")
        name = info.name
        if wanted is not None and wanted != name:
            raise ModelNotFound(f"the model {wanted!r} does not exist; this gateway serves "
                                f"{name!r}", param="model")
        return name

    def _model_obj(self, name: str) -> dict:
        """`max_model_len`: the most tokens (prompt + output) a request can have here, the
        model's limit or the gateway's (--max-prompt-tokens + --max-tokens-limit)."""
        cfg = self.core.cfg
        limit = min(self.core.info.max_seq_len, cfg.max_prompt_tokens + cfg.max_tokens_limit)
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": limit}

    async def models(self, request: Request):
        try:
            self.core.authenticate(request.headers.get("authorization"))
            name = await self._model_id()
        except KvmeshError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [self._model_obj(name)]})

    async def model(self, request: Request):
        try:
            self.core.authenticate(request.headers.get("authorization"))
            name = await self._model_id(request.path_params["model_id"])
        except KvmeshError as exc:
            return error_response(exc)
        return JSONResponse(self._model_obj(name))

    # --- tokenizer routes (openai_api/tokenize.py) ----------------------------------------
    async def tokenize(self, request: Request):
        try:
            self.core.authenticate(request.headers.get("authorization"))
            text, model = tokenize.tokenize_text(await self._json_body(request), self.template)
            await self._model_id(model)
        except KvmeshError as exc:
            return error_response(exc)
        ids = self.core.tokenizer.encode(text)
        return JSONResponse({"count": len(ids), "tokens": ids,
                             "max_model_len": self._model_obj("")["max_model_len"]})

    async def detokenize(self, request: Request):
        try:
            self.core.authenticate(request.headers.get("authorization"))
            body = await self._json_body(request)
            await self._model_id()                      # the vocabulary is the model's
            ids, model = tokenize.detokenize_ids(body, self.core.info.vocab_size)
            await self._model_id(model)
        except KvmeshError as exc:
            return error_response(exc)
        return JSONResponse({"prompt": self.core.tokenizer.decode(ids)})

    async def version(self, request: Request):
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("kvmesh")
        except PackageNotFoundError:      # a source tree without `pip install -e`
            v = "unknown"
        return JSONResponse({"version": v})

    async def health(self, request: Request):
        n = len(self.core.router.candidates(self.core.clock()))
        return JSONResponse({"status": "ok" if n else "no engine", "engines": n},
                            status_code=200 if n else 503)

    async def metrics(self, request: Request):
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def _http_exception(self, request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(exc.status_code, msg, code), status_code=exc.status_code)

