"""The compiled CPU library builds, here and for every x86 instruction set it has a path for.

Each kernel has an AVX-512 path, an AVX2 one for the hot loops and a plain C one, chosen by
the compiler's macros for the CPU it builds on (-march=native). A path that does not compile
is invisible on a machine that never takes it, and the engine then falls back to torch with
a warning: an AVX2 machine (Zen 3) met a missing <stddef.h> that the AVX-512 path had
included by way of <immintrin.h>, and its decode steps took 22.6 ms at batch 1 and 55.1 at
batch 32 on torch's paths against 9.2 and 22.9 with the library."""

import platform
import subprocess

import pytest
import torch

from kernels import cpu_gemm, cpu_ring

needs_cc = pytest.mark.skipif(cpu_ring._compiler() is None, reason="no C compiler on this machine")


@needs_cc
def test_the_library_builds_and_loads_here():
    assert cpu_ring.load() is not None
    assert cpu_ring.library(torch.zeros(1)) is not None


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 levels only")
def test_every_x86_path_compiles(tmp_path):
    """x86-64 (no SIMD past SSE2: the plain paths), v3 (AVX2 + FMA), v4 (AVX-512)."""
    cc = cpu_ring._compiler()
    flags = [f for f in cpu_ring.FLAGS if not f.startswith("-march")]
    builds = {level: subprocess.Popen(
        [cc, *flags, f"-march={level}", "-o", str(tmp_path / f"{level}.so"),
         *map(str, cpu_ring.SOURCES), "-lm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for level in ("x86-64", "x86-64-v3", "x86-64-v4")}
    for level, build in builds.items():
        _, err = build.communicate(timeout=300)
        if build.returncode and "unknown value" in err:      # an older compiler's -march
            continue
        assert build.returncode == 0, f"{level}: {err}"


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 levels only")
def test_a_library_without_products_packs_nothing_and_takes_torch(monkeypatch, tmp_path):
    """Built for plain x86-64 (no AVX2), the library has no matrix products: the runner's
    packing packs nothing and every product is torch's, with its numbers."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ring, "FLAGS", [f if not f.startswith("-march") else "-march=x86-64"
                                            for f in cpu_ring.FLAGS])
    monkeypatch.setattr(cpu_ring, "_tried", False)
    monkeypatch.setattr(cpu_ring, "_lib", None)
    monkeypatch.setattr(cpu_gemm, "_refused", False)
    monkeypatch.setattr(cpu_gemm, "_packed", {})
    assert cpu_ring.load() is not None
    assert cpu_gemm.panel_cols(torch.float32) == 0
    w, x = torch.randn(64, 48), torch.randn(5, 64)
    cpu_gemm.pack_weights([w])
    assert id(w) not in cpu_gemm._packed
    assert torch.equal(cpu_gemm.matmul(x, w), x @ w)
    assert cpu_gemm._refused
