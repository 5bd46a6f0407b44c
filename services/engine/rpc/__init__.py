"""The engine's network side: the EngineService servicer and Session streams, the server,
the typed client, peer snapshot transfer and the remote cache tiers."""
