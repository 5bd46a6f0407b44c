"""kernels/dispatch.forced: read on every kernel call, so a test or an operator can flip it."""

import pytest

from kvmesh.kernels import dispatch


def test_forced_follows_the_environment(monkeypatch):
    monkeypatch.delenv("KVMESH_KERNELS", raising=False)
    assert dispatch.forced() is None
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert dispatch.forced() == "torch"
    monkeypatch.setenv("KVMESH_KERNELS", " Triton ")
    assert dispatch.forced() == "triton"
    for unset in ("", "auto"):
        monkeypatch.setenv("KVMESH_KERNELS", unset)
        assert dispatch.forced() is None
    monkeypatch.setenv("KVMESH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="must be torch, triton or unset"):
        dispatch.forced()
    monkeypatch.delenv("KVMESH_KERNELS")
    assert dispatch.forced() is None
