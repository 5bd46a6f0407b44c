"""An asyncio loop in a background thread, so synchronous tests can drive async servers
and clients (grpc.aio objects must be created on the loop that uses them)."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def make(self, factory, *args):
        """Call factory(*args) on the loop (for objects that bind to the running loop)."""
        async def build():
            return factory(*args)

        return self.run(build())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
