"""AsyncEngine: runs EngineCore in one background thread, serves asyncio callers.

The engine thread is the only thread that touches EngineCore. Callers send
commands through a queue (add, abort, call) and receive events through their
own asyncio.Queue, posted with `call_soon_threadsafe`. A caller that goes away
(cancelled, deadline passed, client gone) aborts its request, which frees the
sequence's slot and blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from services.engine.engine import EngineCore, Event

log = logging.getLogger("kvmesh.engine")


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- caller side (event loop) ---------------------------------------------------
    async def generate(self, prompt_ids, params, request_id="", salt="", traffic_class="",
                       prefetched=None) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        fut: cf.Future = cf.Future()
        self._cmds.put(("add", (prompt_ids, params, request_id, salt, traffic_class, prefetched),
                        fut, loop, sink))
        seq = await asyncio.wrap_future(fut)          # raises InvalidArgument etc.
        done = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish is not None:
                    done = True
                    return
        finally:
            if not done:
                self._cmds.put(("abort", seq.request_id))

    async def call(self, fn: Callable[[EngineCore], object]):
        """Run fn(core) on the engine thread (stats, integrity checks, snapshots)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def post(self, fn: Callable[[EngineCore], object]) -> cf.Future:
        """Queue fn(core) for the engine thread without waiting for it (counters written
        from the event loop); commands run in the order they were queued."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout=10)

    # --- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.core.has_work)
                if self.core.has_work:
                    for ev in self.core.step():
                        self._deliver(ev)
            except Exception as exc:  # noqa: BLE001 - keep serving; fail what was in flight
                log.exception("engine step failed")
                for rid in list(self._sinks):
                    self._post(rid, exc)
                    self.core.abort(rid)
                    self._sinks.pop(rid, None)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, args, fut, loop, sink = cmd
            try:
                seq = self.core.add_request(*args)
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                fut.set_exception(exc)
                return
            self._sinks[seq.request_id] = (loop, sink)
            fut.set_result(seq)
        elif kind == "abort":
            self.core.abort(cmd[1])
            self._sinks.pop(cmd[1], None)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.core))
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(exc)

    def _deliver(self, ev: Event) -> None:
        self._post(ev.request_id, ev)
        if ev.finish is not None:
            self._sinks.pop(ev.request_id, None)

    def _post(self, rid: str, item) -> None:
        target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._sinks.pop(rid, None)
