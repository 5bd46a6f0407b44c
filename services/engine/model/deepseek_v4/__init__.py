"""DeepSeek V4 as published: its config, checkpoints, forward, and its cached path.

    config.py      config.json in transformers' or DeepSeek's form -> V4Config
    names.py       stored tensor names -> this package's names; every expected shape
    quant.py       FP8 (128 x 128 block scales) and FP4 (1 x 32) -> floats
    checkpoint.py  a directory -> (V4Config, weights), failures named by file and tensor
    numerics.py    norms and RoPE with the reference's fp32 steps
    hyper.py       hyper-connections (the residual streams)
    compressor.py  CSA / HCA pooling and the lightning indexer
    attention.py   window + compressed attention with sinks and the grouped output
    moe.py         routing, grouped expert products, the shared expert
    forward.py     the whole model over one sequence: the oracle for the cached path
    score.py       `kvmesh score`: log-probabilities and argmax of a sequence
    layout.py      both ledgers' sizes from a config (`kvmesh engine layout --model`)
    cached.py      the model in pieces, each layer's state kept in memory between calls
    ledgers.py     the same state in the engine's slots and blocks; batched steps, bounded
                   replay, rollback
    snapshots.py   block-boundary snapshots, block bytes, prefill -> decode hand-off
    speculate.py   greedy verification of drafted tokens

DeepSeek V4's chat encoding is kvmesh/chat_deepseek_v4.py (the gateway needs it too).
Pinned against transformers 5.23.0 (tests/engine/deepseek_v4/), which is never imported here.
May import: torch, safetensors, kernels, kvmesh.errors, and kvmesh.services.engine.cache (the engine's
BlockPool, BlockStore and slot Region, which the ledger path keeps its blocks in).
"""
