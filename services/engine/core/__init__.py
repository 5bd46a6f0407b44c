"""The engine core: V4Engine (admission, steps, prefix reuse, handoffs), its request record
(v4_request.py), sampling, output and speculation, and the thread bridge (AsyncEngine) the
asyncio side uses. No gRPC."""
