"""Which implementation of a hot operation runs: the plain-torch reference or Triton.

    default              Triton for CUDA tensors, torch for everything else
    KVMESH_KERNELS=torch   always the torch reference
    KVMESH_KERNELS=triton  always Triton; on CPU only under TRITON_INTERPRET=1 (Triton's
                           interpreter, which must be set before triton is first imported)

The Triton kernels compute in fp32; float64 tensors (the exactness tests of the engine)
always take the torch path, forced or not. On CPU MXFP8 quantization has a compiled kernel
of its own (kernels/cpu_library.py), used when KVMESH_KERNELS is unset.

The choice is read on every call (one dict lookup), so a test can flip it with
monkeypatch. The Triton modules are imported only when first chosen: importing
kernels/ never imports triton, and a process that never asks for Triton never pays for it.
"""

from __future__ import annotations

import os

import torch

CHOICES = ("torch", "triton")


# os.environ.get costs ~0.8 us (the key is encoded and the value decoded by Python code), and
# every kernel call asks (~150 a decode step): where the environment is bytes (POSIX),
# CPython's mapping keeps them in `_data`, which setenv, monkeypatch and os.environ's own
# writes all update, so one dict lookup there reads the same value (0.03 us). Elsewhere the
# plain lookup.
_RAW: dict | None = getattr(os.environ, "_data", None) if os.supports_bytes_environ else None
_RAW_KEY = b"KVMESH_KERNELS"


def forced() -> str | None:
    if _RAW is not None:
        raw = _RAW.get(_RAW_KEY)
        if not raw:            # the common case, asked on every kernel call: one dict lookup
            return None
    value = os.environ.get("KVMESH_KERNELS")
    if not value:
        return None
    value = value.strip().lower()
    if value in ("", "auto"):
        return None
    if value not in CHOICES:
        raise ValueError(f"KVMESH_KERNELS must be torch, triton or unset, not {value!r}")
    return value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the operation on tensor `t` should run its Triton kernel."""
    choice = forced()
    if choice == "torch" or t.dtype == torch.float64:
        return False
    if choice == "triton":
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                "KVMESH_KERNELS=triton on a CPU tensor needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before starting the process "
                "(or unset KVMESH_KERNELS to use the torch kernels on CPU)")
        return True
    return t.device.type == "cuda"
