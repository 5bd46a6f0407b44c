"""Hot operations behind small, fixed signatures: a plain-torch implementation each, a Triton
version behind the same signature (kernels/dispatch.py chooses), and on the CPU a compiled
path where torch has no fast one. The model code calls only these functions.

    moe.py          grouped expert products: each routed expert's weight over its own rows
    mxfp8.py        quantize / dequantize window rows (E4M3 values + E8M0 scales, 528 B per
                    512-d row), with a compiled CPU path (kernels/cpu/mxfp8.c)
    cpu_library.py  builds and loads the compiled CPU library (kernels/cpu/*.c)
    host_memory.py  the large CPU tensors (the block ledger's) on 2 MB pages
"""
