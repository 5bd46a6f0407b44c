"""The engine core: EngineCore, its scheduler, sequences, sampling and output, and the
thread bridge (AsyncEngine) the asyncio side uses. No gRPC."""
