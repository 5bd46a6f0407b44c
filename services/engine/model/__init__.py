"""V4-mini: weights, per-token operations and the plain full-sequence reference.

    weights.py    seeded init, safetensors save/load with config check
    ops.py        per-token pieces shared by every forward (norms, RoPE, projections)
    reference.py  full-sequence forward with explicit masks, no cache: the oracle
                  the cached engine path is tested against
"""
