"""Training the shipped models on CPU (outside the serving package: no service imports it).

    v41_model.py, v41_data.py, v41_loop.py, v41_evaluate.py
                 `kvmesh train`: the shipped DeepSeek V4.1 model's differentiable forward,
                 its code + English corpus, the resumable loop, held-out bits/byte
    bpe.py       `kvmesh train-tokenizer`: the byte-level BPE tokenizer with DeepSeek's
                 special tokens
    data.py      the Python standard library's files, held out by a hash of their names
    steps.py     the step loop: seeded, resumable AdamW with progress lines and a time budget
    cli.py       the commands
"""
