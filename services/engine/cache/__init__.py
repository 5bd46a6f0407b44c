"""What the model's two cache ledgers share (the ledgers themselves:
model/deepseek_v4/ledgers.py and v41_ledgers.py).

    block_pool.py    BlockPool: paged 128-token blocks of compressed entries, refcounts, hashes, LRU
    block_store.py   BlockStore: the tensors behind block ids (entries + indexer keys per layer),
                     serialized as the kvstore keeps them
    state_layout.py  Region: one tensor's place in a state slot's bytes
    snapshots.py     SnapshotStore: the stored window snapshots (bytes LRU + TTL)
    slot_handoff.py  SlotHandoff: a sequence's slot and blocks on their way to a decode engine
    prefetch.py      LocalView / Prefetched: what a prompt finds here and in the other tiers

Layers do not import upwards: nothing here imports the engine core or the service.
"""
