"""Starting the ranks of a model split tensor x expert parallel (docs/design.md §15).

Two ways in, as torch.distributed has them:

  - a command given `--tensor-parallel N --expert-parallel M` starts N x M processes itself
    (`run`): torch.multiprocessing with a rendezvous on a free loopback port;
  - under an external launcher (torchrun, a batch system) the process is already one rank:
    `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK` for its GPU) are set,
    and `run` joins that group instead of starting one; WORLD_SIZE must be N x M.

Process groups use NCCL when the ranks compute on CUDA devices, gloo otherwise. A rank that
fails takes the others down: `run` raises in the starting process (torch.multiprocessing
ends the other ranks), and collectives time out after `TIMEOUT` rather than hang.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvmesh.services.engine.model.deepseek_v4.parallel import Split

TIMEOUT = datetime.timedelta(minutes=5)
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_outside() -> bool:
    """Whether this process is one rank of a group an external launcher started."""
    return all(name in os.environ for name in _ENV)


def run(fn: Callable[..., Any], args: tuple, tp: int, ep: int) -> Any:
    """fn(split, *args) on every rank of a tp x ep group (fn and args picklable: the ranks
    are spawned processes). Returns rank 0's result where this process started the ranks
    or is rank 0 itself, None on the other ranks of an external launcher's group."""
    if tp < 1 or ep < 1:
        raise ValueError(f"--tensor-parallel and --expert-parallel must be >= 1, not {tp}, {ep}")
    if launched_outside():
        world = int(os.environ["WORLD_SIZE"])
        if world != tp * ep:
            raise ValueError(f"WORLD_SIZE is {world}, but --tensor-parallel {tp} x "
                             f"--expert-parallel {ep} needs {tp * ep} ranks")
        return _rank(int(os.environ["RANK"]), fn, args, tp, ep, None)
    if tp * ep == 1:
        return fn(Split(), *args)
    results = mp.get_context("spawn").SimpleQueue()
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    context = mp.start_processes(_rank, args=(fn, args, tp, ep, results), nprocs=tp * ep,
                                 start_method="spawn", join=False)
    handlers = _forward_stop(context.processes[0].pid)
    try:      # joins every rank; one that fails ends the others and raises here
        while not context.join():
            pass
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return results.get()


def failure(exc: BaseException) -> str:
    """The one line to print for a failed rank (torch.multiprocessing's ProcessException):
    the rank's error message without its traceback and exception class."""
    line = str(exc).strip().splitlines()[-1]
    head, sep, message = line.partition(": ")
    return message if sep and head.replace(".", "").replace("_", "").isalnum() else line


def _forward_stop(rank0_pid: int) -> dict:
    """SIGTERM / SIGINT to this process stop rank 0, which releases the others (a serving
    engine drains, then they return); the previous handlers, to restore. In the main thread
    only, where Python takes signals."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame) -> None:
        os.kill(rank0_pid, signal.SIGTERM)
    return {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}


def _end_with_parent(signum: int) -> None:
    """Have the kernel send `signum` to this process when the one that started it ends
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)    # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, fn, args: tuple, tp: int, ep: int, results) -> Any:
    if results is not None:          # started by `run`: no rank outlives the starting process
        _end_with_parent(signal.SIGTERM if rank == 0 else signal.SIGKILL)
        if rank != 0:                # a terminal's Ctrl-C reaches every rank: rank 0 stops,
            for signum in (signal.SIGINT, signal.SIGTERM):   # and that releases the others
                signal.signal(signum, signal.SIG_IGN)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=tp * ep, timeout=TIMEOUT)
    try:
        out = fn(Split(tp, ep, rank), *args)
        if results is not None and rank == 0:
            results.put(out)
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()
