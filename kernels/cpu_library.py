"""The compiled CPU library: kernels/cpu/*.c, built on first use with the machine's C
compiler and called through ctypes. Today it holds MXFP8 quantization (mxfp8.c, called by
kernels/mxfp8.py): torch's float8 conversion and the scale arithmetic are some twenty calls
per layer where the C kernel is one pass over the rows.

The library is built once per source, compiler and CPU into the cache directory
($KVMESH_CACHE_DIR, else $XDG_CACHE_HOME/kvmesh, else ~/.cache/kvmesh) and reused by every
process. No compiler, a failed build or KVMESH_KERNELS set: `library()` is None and callers
take the torch path (the same bytes; tested). Only a plain `cc`-style compiler is needed: no
Python headers, no torch headers, no build tool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvmesh.kernels import dispatch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("cpu").glob("*.c"))
HEADERS = sorted(Path(__file__).with_name("cpu").glob("*.h"))     # included by SOURCES: in the key
# No -ffast-math or -fassociative-math: the kernel's sums are split into lanes by hand, and
# reassociating x * 2^120 * scale into x * (2^120 * scale) overflows. -march=native: the
# library is cached per CPU (the cache key has the CPU's flags).
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp",
         "-shared", "-fPIC"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    """Where built libraries are kept: $KVMESH_CACHE_DIR, else the user's cache directory,
    else (a home that cannot be written, as in some containers) the temp directory."""
    if os.environ.get("KVMESH_CACHE_DIR"):
        return Path(os.environ["KVMESH_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "kvmesh"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"kvmesh-{os.getuid()}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    """The cached library, compiled first if needed: with OpenMP, else (a compiler without
    it) single-threaded: the pragma is then ignored and the result the same."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    errors = []
    for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"]):
        sources = [f"{p.name}\0{p.read_text()}" for p in SOURCES + HEADERS]
        key = hashlib.sha256("\0".join([*sources, " ".join(flags), version,
                                        _cpu_flags()]).encode()).hexdigest()[:16]
        out = cache_dir() / "kernels" / f"kvmesh-cpu-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        # another process may build the same library at the same time: each writes its own
        # file and renames it into place (atomic), so a reader never loads half a library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, out)
                return out
            errors.append(done.stderr.strip()[:1000])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cc} failed: {errors[-1]}")


def load() -> ctypes.CDLL | None:
    """The library, built on the first call; None where it cannot be (no compiler, a failed
    build). Callers go through `library`, the gate."""
    global _lib, _tried
    if _tried:                 # every kernel call asks: no lock once the answer is known
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = _compiler()
        if cc is None:
            log.info("no C compiler: the CPU kernels take their torch paths")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("the CPU kernel library did not build (%s); using torch", e)
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.mxfp8_quantize.argtypes = [p, i64, i64, p, p, ctypes.c_int]
        lib.mxfp8_quantize.restype = ctypes.c_int
        _lib = lib
        return lib


def library(t: torch.Tensor) -> ctypes.CDLL | None:
    """The compiled library for work on `t`, or None where the caller takes its torch path:
    not a CPU tensor, under autograd (no backward here), KVMESH_KERNELS set (torch or triton
    forced take their own paths), or no library. The one gate of every caller
    (kernels/mxfp8.py), asked on every kernel call: `is_cpu` reads a flag where
    `device.type` builds a device object (0.04 against 0.25 us)."""
    if not t.is_cpu or t.requires_grad or dispatch.forced() is not None:
        return None
    return load()
