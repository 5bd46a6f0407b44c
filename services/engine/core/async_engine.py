"""AsyncEngine: runs the engine core (Engine) in one background thread, serves asyncio callers.

The engine thread is the only thread that touches the core. Callers send
commands through a queue (add, abort, call) and receive events through their
own asyncio.Queue, posted with `call_soon_threadsafe`. A caller that goes away
(cancelled, deadline passed, client gone) aborts its request, which frees the
sequence's slot and blocks at the next step boundary.

Cancellation can come at any moment, including while a command waits in the
queue. Each command carries a `concurrent.futures.Future`; the engine thread
claims it with `set_running_or_notify_cancel()` before doing the work, so a
command whose caller already left is skipped, and a claimed one can no longer
be cancelled (its result always lands). A caller cancelled after its `add`
was claimed queues an `abort_admitted` behind it, which the thread (FIFO)
sees after the add and uses to drop the admitted sequence. Nothing a caller
does can raise on the engine thread, so one client's cancel never reaches
another client's stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from kvmesh.services.engine.core.events import Event

if TYPE_CHECKING:
    from kvmesh.services.engine.core.engine import Engine

log = logging.getLogger("kvmesh.engine")


class AsyncEngine:
    def __init__(self, core: Engine):
        self.core = core
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- caller side (event loop) ---------------------------------------------------
    def generate(self, prompt_ids, params, request_id="", salt="", traffic_class="",
                 prefetched=None, resume: int = 0, handoff: bool = False) -> AsyncIterator[Event]:
        return self._stream(lambda core: core.add_request(
            prompt_ids, params, request_id, salt, traffic_class, prefetched, resume, handoff))

    def adopt(self, handoff) -> AsyncIterator[Event]:
        """Continue a request a prefill engine handed off (Engine.adopt)."""
        return self._stream(lambda core: core.adopt(handoff))

    async def _stream(self, start: Callable[[Engine], object]) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        fut: cf.Future = cf.Future()
        self._cmds.put(("add", start, fut, loop, sink))
        try:
            seq = await asyncio.wrap_future(fut)      # raises InvalidArgument etc.
        except asyncio.CancelledError:
            # wrap_future cancelled `fut`: if the thread had not claimed it, the add is
            # skipped; if it had, the sequence is admitted and must be dropped again.
            self._cmds.put(("abort_admitted", fut))
            raise
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

    async def call(self, fn: Callable[[Engine], object]):
        """Run fn(core) on the engine thread (stats, integrity checks, snapshots)."""
        fut: cf.Future = cf.Future()
        self._cmds.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def post(self, fn: Callable[[Engine], object]) -> cf.Future:
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
            self._drain(block=not self.core.has_work)
            if not self.core.has_work:
                continue
            try:
                events = self.core.step()
            except Exception as exc:  # noqa: BLE001 - keep serving; fail what was in flight
                # A failed step leaves no request in a known state, so every running one
                # is failed and freed. Commands never get here: `_handle` contains its own.
                log.exception("engine step failed")
                for rid in list(self._sinks):
                    self._post(rid, exc)
                    self.core.abort(rid)
                    self._sinks.pop(rid, None)
                continue
            self._deliver_all(events)

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
            _, start, fut, loop, sink = cmd
            if not fut.set_running_or_notify_cancel():
                return                    # the caller left before admission: nothing to undo
            try:
                seq = start(self.core)
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                fut.set_exception(exc)
                return
            self._sinks[seq.request_id] = (loop, sink)
            fut.set_result(seq)
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_admitted":
            fut = cmd[1]
            # Done without exception = the add ran and admitted a sequence nobody will read.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._abort(fut.result().request_id)
        elif kind == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return                    # the caller left (e.g. a stats call timed out)
            try:
                result = fn(self.core)
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                fut.set_exception(exc)
                return
            fut.set_result(result)

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._sinks.pop(request_id, None)

    def _deliver_all(self, events: list[Event]) -> None:
        """A step's events, handed to each caller's loop in one wake-up (one
        call_soon_threadsafe per loop, not one per stream: at 32 streams the wake-ups alone
        cost the loop thread a share of the GIL the engine thread then waits for)."""
        batches: dict[object, list] = {}
        for ev in events:
            target = self._sinks.get(ev.request_id)
            if target is not None:
                loop, sink = target
                batches.setdefault(loop, []).append((sink, ev))
            if ev.finish is not None:
                self._sinks.pop(ev.request_id, None)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the callers' loop is closed
                for rid in [r for r, (lp, _) in self._sinks.items() if lp is loop]:
                    self._sinks.pop(rid, None)

    def _post(self, rid: str, item) -> None:
        target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._sinks.pop(rid, None)


def _put_all(items) -> None:
    for sink, item in items:
        sink.put_nowait(item)
