"""The engine core: Engine (admission, steps, prefix reuse, handoffs), its request record
(request.py), sampling, output and speculation, and the thread bridge (AsyncEngine) the
asyncio side uses. No gRPC."""
