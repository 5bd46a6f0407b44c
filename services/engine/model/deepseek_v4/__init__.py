"""DeepSeek V4 as published: its config, checkpoints and a full-sequence forward.

    config.py      config.json in transformers' or DeepSeek's form -> V4Config
    names.py       stored tensor names -> this package's names; every expected shape
    quant.py       FP8 (128 x 128 block scales) and FP4 (1 x 32) -> floats
    checkpoint.py  a directory -> (V4Config, weights), failures named by file and tensor
    numerics.py    norms and RoPE with the reference's fp32 steps
    hyper.py       hyper-connections (the residual streams)
    compressor.py  CSA / HCA pooling and the lightning indexer
    attention.py   window + compressed attention with sinks and the grouped output
    moe.py         routing, grouped expert products, the shared expert
    forward.py     the whole model over one sequence: the oracle for the cached engine path

Pinned against transformers 5.23.0 (tests/engine/deepseek_v4/), which is never imported here.
May import: torch, safetensors, kvmesh.errors.
"""
