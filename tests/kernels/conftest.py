"""Kernel tests: each Triton kernel against its torch reference.

Without CUDA the kernels run in Triton's interpreter. Interpreter mode is fixed when a
@triton.jit function is decorated (at import), so TRITON_INTERPRET=1 is set only while
the kernel modules are imported here and restored at once: other test modules never see
it (the dispatch check for a forced KVMESH_KERNELS=triton is given it per test below).
With CUDA the same tests run the compiled kernels on the device.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

if not CUDA:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import kvmesh.kernels.triton.moe  # noqa: F401,E402
    import kvmesh.kernels.triton.mxfp8  # noqa: F401,E402
finally:
    if not CUDA:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture
def device():
    """Where the kernels under test run: cuda when there is one, else the interpreter on CPU."""
    return DEVICE


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """Within a kernel test the environment says what the imported kernels are."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVMESH_KERNELS", raising=False)
