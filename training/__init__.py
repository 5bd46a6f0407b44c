"""Training the shipped models on CPU (outside the serving package: no service imports it).

    v41_model.py, v41_data.py, v41_loop.py, v41_evaluate.py
                 `kvmesh train-v41`: the shipped DeepSeek V4.1 model's differentiable forward,
                 its code + English corpus, the resumable loop, held-out bits/byte
    bpe.py       `kvmesh train-tokenizer`: the byte-level BPE tokenizer with DeepSeek's
                 special tokens
    model.py, data.py, loop.py, evaluate.py, mtp.py, mtp_chain.py
                 `kvmesh train`, `train-mtp`, `train-eval`: V4-mini (being retired), the
                 Python standard library as a byte stream held out by file, seeded resumable
                 AdamW loops with progress lines and safetensors checkpoints
    cli.py       the commands
"""
