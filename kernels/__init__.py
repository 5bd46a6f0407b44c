"""Hot operations behind small, fixed signatures.

Each file holds one operation as a plain-torch implementation; Triton versions
plug in behind the same signatures. The model code calls only these functions.

    mxfp8.py       quantize / dequantize SWA KV (E4M3 values + E8M0 scales, 528 B per 512-d token)
    attention.py   one softmax over window keys + compressed entries, with an attention sink
    indexer.py     lightning-indexer scores and top-k selection of compressed entries
    pooling.py     softmax-gated pooling of m tokens into one compressed entry

On the CPU some of them have a compiled path as well (kernels/cpu/*.c, one library built on
first use by cpu_ring.py, gated by cpu_ring.library): ring attention of decode rows
(cpu_ring.py), MXFP8 quantization (mxfp8.py) and matrix products (cpu_gemm.py). host_memory.py puts the large CPU tensors they
read (slot pool, block store, window mirror, weight panels) on 2 MB pages.
"""
