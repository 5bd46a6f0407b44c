"""Triton kernels behind the signatures of kernels/*.py (imported only through dispatch).

Each function here takes and returns what its torch reference does; the references stay
the oracles (tests/kernels/ compares every kernel with them under TRITON_INTERPRET=1).
"""
