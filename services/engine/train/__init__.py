"""Training V4-mini on CPU: a differentiable forward, the stdlib corpus, the loop, evaluation.

    model.py     training forward: the reference's math batched, window attention in
                 chunks, top-k as a hard index, indexer trained by KL (no MXFP8 unless asked)
    data.py      the Python standard library as a byte stream, held-out split by file
    loop.py      AdamW loop: seeded, resumable, progress lines, safetensors checkpoints
    evaluate.py  validation bits/byte, byte-unigram baseline, context beyond the window
    cli.py       `kvmesh train` and `kvmesh train-eval`
"""
