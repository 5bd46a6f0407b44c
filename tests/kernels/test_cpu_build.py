"""The compiled CPU library builds, here and for every x86 instruction set it has a path for.

A kernel may have an AVX-512 path, an AVX2 one and a plain C one, chosen by the compiler's
macros for the CPU it builds on (-march=native). A path that does not compile is invisible
on a machine that never takes it, and the engine then falls back to torch with a warning
(an AVX2 machine once met a missing header that the AVX-512 path had included by way of
<immintrin.h>): every level is compiled here."""

import platform
import subprocess

import pytest
import torch

from kvmesh.kernels import cpu_library

needs_cc = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler on this machine")


@needs_cc
def test_the_library_builds_and_loads_here():
    assert cpu_library.load() is not None
    assert cpu_library.library(torch.zeros(1)) is not None


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 levels only")
def test_every_x86_path_compiles(tmp_path):
    """x86-64 (no SIMD past SSE2: the plain paths), v3 (AVX2 + FMA), v4 (AVX-512)."""
    cc = cpu_library._compiler()
    flags = [f for f in cpu_library.FLAGS if not f.startswith("-march")]
    builds = {level: subprocess.Popen(
        [cc, *flags, f"-march={level}", "-o", str(tmp_path / f"{level}.so"),
         *map(str, cpu_library.SOURCES), "-lm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for level in ("x86-64", "x86-64-v3", "x86-64-v4")}
    for level, build in builds.items():
        _, err = build.communicate(timeout=300)
        if build.returncode and "unknown value" in err:      # an older compiler's -march
            continue
        assert build.returncode == 0, f"{level}: {err}"
