"""Decode attention on the CPU over MXFP8 ring bytes and compressed entries read in place:
kernels/cpu/union_attention.c, built on first use with the machine's C compiler and called
through ctypes. Every C file in kernels/cpu/ goes into the one library (mxfp8.c: MXFP8
quantization, kernels/mxfp8.py; gemm.c: matrix products, kernels/cpu_gemm.py;
indexer_topk.c: the indexer's picks, kernels/cpu_indexer.py; put_rows.c: ring row writes,
kernels/ring_rows.put_at).

Why a compiled kernel: a decode row reads its slot's whole window (R ring rows) every layer,
so a batched decode step is bound by reading rings. torch has no CPU op that reads the
528-byte MXFP8 rows and dequantizes them on the way (its float8 conversion is slower than
the fp32 read it would save), so the torch path reads the fp32 mirror, 2,048 bytes a row.
The C kernel reads the bytes and expands each row in L1.

The library is built once per source, compiler and CPU into the cache directory
($KVMESH_CACHE_DIR, else $XDG_CACHE_HOME/kvmesh, else ~/.cache/kvmesh) and reused by every
process. No compiler, a failed build or KVMESH_KERNELS=torch: `available()` is False and
callers take the torch path (the same numbers up to summation order; tested). Only a plain
`cc`-style compiler is needed: no Python headers, no torch headers, no build tool.
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

from kernels import dispatch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("cpu").glob("*.c"))
HEADERS = sorted(Path(__file__).with_name("cpu").glob("*.h"))     # included by SOURCES: in the key
# No -ffast-math or -fassociative-math: the kernel's sums are split into lanes by hand, and
# reassociating x * 2^120 * scale into x * (2^120 * scale) overflows. -march=native: the
# library is cached per CPU (the cache key has the CPU's flags).
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp",
         "-shared", "-fPIC"]

MAX_D = 1024              # the C file's MAX_D: its per-thread row buffers are sized by it
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
            log.info("no C compiler: decode attention reads the fp32 ring mirror (torch)")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("the CPU ring-attention kernel did not build (%s); using torch", e)
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for name in ("union_attention_f32", "union_attention_f64"):
            fn = getattr(lib, name)
            fn.argtypes = [p, p, p, p, i64, i64, i64, p, p, p, i64, i64, p, p, p, i64, i64, p,
                           p, p, i64, i64, i64, ctypes.c_double, ctypes.c_int]
            fn.restype = ctypes.c_int
        lib.indexer_topk_f32.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, p, p,
                                         ctypes.c_int, p, p]
        lib.indexer_topk_f32.restype = ctypes.c_int
        for name in ("gemm_f32", "gemm_f64"):
            fn = getattr(lib, name)
            fn.argtypes = [p, i64, p, i64, p, i64, i64, i64, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
        lib.gemm_panel_cols.argtypes = [ctypes.c_int]
        lib.gemm_panel_cols.restype = ctypes.c_int
        for name in ("gemm_packed_f32", "gemm_packed_f64"):
            fn = getattr(lib, name)
            fn.argtypes = [p, i64, p, p, i64, i64, i64, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
        lib.put_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, i64, i64]
        lib.put_rows.restype = i64
        lib.mxfp8_quantize.argtypes = [p, i64, i64, p, p, ctypes.c_int]
        lib.mxfp8_quantize.restype = ctypes.c_int
        _lib = lib
        return lib


def library(t: torch.Tensor, dtypes=(torch.float32, torch.float64)) -> ctypes.CDLL | None:
    """The compiled library for work on `t`, or None where the caller takes its torch path:
    not a CPU tensor of one of `dtypes` (None: any), under autograd (no backward here),
    KVMESH_KERNELS set (torch or triton forced take their own paths), or no library. The one
    gate of every caller (ring attention here, kernels/mxfp8.py, kernels/cpu_gemm.py,
    kernels/cpu_indexer.py), asked on every kernel
    call: `is_cpu` reads a flag where `device.type` builds a device object (0.04 against
    0.25 us)."""
    if not t.is_cpu or t.requires_grad or (dtypes is not None and t.dtype not in dtypes):
        return None
    if dispatch.forced() is not None:
        return None
    return load()


def available(q: torch.Tensor) -> bool:
    """True when q's ring attention can run here: `library(q)` and a head size D (q's last
    dimension) the kernel takes."""
    return takes(q.shape[-1]) and library(q) is not None


def _table_args(table, t: int, d: int, keep: list) -> list:
    """A table group's five C arguments (NULL and zeros for none), its tensors kept alive."""
    if table is None:
        return [None, None, None, 0, 0]
    rows, idx, ok = table
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != d or rows.stride(1) != 1:
        raise ValueError(f"table rows must be [N, {d}] float32 with contiguous rows, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    idx, ok = idx.to(torch.int64).contiguous(), ok.to(torch.bool).contiguous()
    if idx.dim() != 2 or idx.shape[0] != t or ok.shape != idx.shape:
        raise ValueError(f"table idx and ok must be [{t}, K], got {tuple(idx.shape)} "
                         f"and {tuple(ok.shape)}")
    keep += [rows, idx, ok]
    return [rows.data_ptr(), idx.data_ptr(), ok.data_ptr(), idx.shape[1], rows.stride(0)]


def union_attention(q: torch.Tensor, scale: float, ring=None, table=None, sink=None,
                    table2=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (float32 or float64) over up to three key groups, one softmax:
        ring  = (codes [S, R, D + D / 32] uint8, slots [T] long, ok [T, R] bool): row t sees
                ring row r of slot slots[t] where ok; each ring row's bytes contiguous (a
                strided slot dimension is fine);
        table = (rows [N, D] float32, idx [T, K] long, ok [T, K] bool): row t sees
                rows[idx[t, k]] where ok (a decode row's compressed entries, read in place;
                the block store keeps them in fp32 whatever the engine's dtype);
        table2 = a second group like table (a prefill chunk's window keys beside its entries);
        sink  = [H]: one more softmax column per head whose value is 0 (the model's attention
                sink), so out is the whole attention output and no join is left to do.
    -> (out [T, H, D], lse [T, H]); a row that sees nothing gets out 0 and lse -inf (with a
    sink: out 0 and lse the sink).
    Call only when available(q); indices must be in range (the caller's)."""
    lib = load()
    assert lib is not None
    t, h, d = q.shape
    if not takes(d):
        raise ValueError(f"head_dim {d}: the kernel takes multiples of 32 up to {MAX_D}")
    q = q.contiguous()
    keep = [q]                     # what the pointers below point into, alive past the call
    ring_args: list = [None, None, None, 0, 0, 0]
    if ring is not None:
        codes, slots, ok = ring
        s, r, width = codes.shape
        if codes.dtype != torch.uint8 or width != d + d // 32 or codes.stride(2) != 1:
            raise ValueError(f"codes must be uint8 [S, R, {d + d // 32}] with contiguous rows "
                             f"for head_dim {d}, got {codes.dtype} {tuple(codes.shape)}")
        slots, ok = slots.to(torch.int64).contiguous(), ok.to(torch.bool).contiguous()
        if tuple(ok.shape) != (t, r) or tuple(slots.shape) != (t,):
            raise ValueError(f"ring ok must be [{t}, {r}] and slots [{t}]")
        keep += [codes, slots, ok]
        ring_args = [codes.data_ptr(), slots.data_ptr(), ok.data_ptr(), r, codes.stride(1),
                     codes.stride(0)]
    table_args = [*_table_args(table, t, d, keep), *_table_args(table2, t, d, keep)]
    sink_ptr = None
    if sink is not None:
        if sink.numel() != h:
            raise ValueError(f"sink must have one logit per head ({h}), got {tuple(sink.shape)}")
        sink = sink.to(q.dtype).contiguous()
        keep.append(sink)
        sink_ptr = sink.data_ptr()
    out = torch.empty_like(q)
    lse = torch.empty(t, h, dtype=q.dtype)
    fn = lib.union_attention_f32 if q.dtype == torch.float32 else lib.union_attention_f64
    fn(q.data_ptr(), *ring_args, *table_args, sink_ptr, out.data_ptr(), lse.data_ptr(), t, h, d,
       scale, torch.get_num_threads())
    del keep
    return out, lse


def ring_attention(q: torch.Tensor, codes: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """union_attention over the ring group alone."""
    return union_attention(q, scale, ring=(codes, slots, ok))


def takes(head_dim: int) -> bool:
    """The head sizes the kernel is built for (MXFP8 blocks of 32; MAX_D in the C file)."""
    return head_dim % 32 == 0 and 0 < head_dim <= MAX_D
