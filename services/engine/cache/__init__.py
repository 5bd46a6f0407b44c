"""The engine's two cache ledgers.

    layout.py        RuntimeLayout: ring sizes, slot and block bytes, built once from the configs
    state_layout.py  StateBlock: byte layout of one state slot, state_size_to_disk
    state_pool.py    StatePool: fixed slots (SWA rings, compression tails), one per running sequence
    block_pool.py    BlockPool: paged 128-token blocks of compressed entries, refcounts, hashes, LRU
    block_store.py   BlockStore: the tensors behind block ids (entries + indexer keys per layer)
    snapshot_keys.py the engine's layout fingerprint; block hashes and snapshot keys
                     themselves are kvmesh/cachekeys.py (the gateway names them too)
    manager.py       CacheManager: the only caller of the pools; prefix matching (MatchResult),
                     admission, growth, commit, release, rollback

Layers do not import upwards: nothing here imports the scheduler or the service.
"""
