"""Which torch device an engine runs on: `--device auto|cpu|cuda|cuda:N` (EngineConfig.device).

`auto` (the default) is CUDA when torch sees a GPU, else the CPU. Asking for CUDA where
there is none is a start-up error that names the flag, not a crash at the first forward.
Weights, the state pool, the block store, the replica area and the runner's window mirror and
per-step index tensors live on this device (Engine places them); the host snapshot store
stays in host memory.
"""

from __future__ import annotations

from array import array
from collections import deque

import torch


def resolve(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available to torch here "
                             "(torch.cuda.is_available() is False); use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
        return dev
    return torch.device(name)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (snapshot bytes, a fetched block) onto `device`: through pinned memory
    with a non-blocking copy on CUDA (stream-ordered: kernels queued after it see the data),
    the tensor itself on the CPU."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Uploads:
    """The one way a step's host ints become index tensors on the device (StepBatch owns one
    per forward).

    On CUDA a copy from pageable memory waits for the stream to drain, so an index tensor
    made from host ints mid-forward would stall behind the layers already queued. Every
    index tensor of a step is therefore built here before its first layer (`seal` marks
    that point): `many` packs several lists into one pinned buffer and makes one
    non-blocking copy; `longs` is the one-list case. On the CPU they are plain tensors.
    `late` counts uploads after `seal` (tests assert 0: each would be a stall on a GPU)."""

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device if device is not None else "cpu")
        self.count = 0
        self.late = 0
        self.sealed = False

    def seal(self) -> None:
        self.sealed = True

    def longs(self, values) -> torch.Tensor:
        return self.many(values)[0]

    def many(self, *lists) -> tuple[torch.Tensor, ...]:
        """Each list (of ints, or of equal-length int lists: a 2-D table) as a long tensor."""
        self.count += 1
        self.late += self.sealed
        host = [_longs(v) for v in lists]
        if self.device.type != "cuda":
            return tuple(t.to(self.device) for t in host)
        flat = torch.cat([t.reshape(-1) for t in host]).pin_memory()
        dev = flat.to(self.device, non_blocking=True)
        out, at = [], 0
        for t in host:
            out.append(dev[at : at + t.numel()].view(t.shape))
            at += t.numel()
        return tuple(out)


def _longs(values) -> torch.Tensor:
    """Host ints (a list, or a list of equal-length lists) as a long tensor. Through an
    int64 array, not torch.tensor: that reads the list an element at a time through
    Python's number protocol (32 ints: 6.1 -> 2.1 us, a 32 x 4 table 12.5 -> 9.0 us), and
    a decode step makes ~20 of these."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    rows = len(values)
    if rows and isinstance(values[0], (list, tuple)):
        width = len(values[0])
        flat = array("q")
        for row in values:
            if len(row) != width:
                raise ValueError(f"rows of {len(row)} and {width} ints in one table")
            flat.extend(row)
        return _from_array(flat).view(rows, width)
    return _from_array(array("q", values))


def _from_array(a: array) -> torch.Tensor:
    # the tensor holds the array (frombuffer keeps a reference): no copy
    return torch.frombuffer(a, dtype=torch.long) if len(a) else torch.empty(0, dtype=torch.long)


class HostCopies:
    """Device bytes on their way to host memory without stalling the decode step.

    On CUDA, `submit` copies into a pinned buffer with a non-blocking copy queued behind the
    step's kernels, records an event, and returns at once; `poll` hands each finished copy's
    bytes to its callback (events of one stream complete in order, so a FIFO suffices) and
    never waits unless told to (`wait=True`: the engine is idle, or a caller needs them
    now). The step's only sync stays the sampled ids (core/sampling.py sample_ids). On the
    CPU the copy is the bytes themselves and the callback runs inside `submit`.

    Stream order makes this safe: a later write to the source (a block or slot reused) is
    queued after the copy. One owner each (Engine for block uploads, PrefixReuse for
    snapshots); the callbacks run on the owner's (engine) thread."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: deque = deque()

    def submit(self, data: torch.Tensor, done) -> None:
        """data: a uint8 tensor on the device; done(bytes) once it is in host memory."""
        if not self.cuda:
            done(data.contiguous().numpy().tobytes())
            return
        buf = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        buf.copy_(data.reshape(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(data.device))   # the stream the copy went on
        self._pending.append((event, buf, done))

    def poll(self, wait: bool = False) -> int:
        """Deliver the finished copies (all of them with `wait`); returns how many."""
        n = 0
        while self._pending and (wait or self._pending[0][0].query()):
            event, buf, done = self._pending.popleft()
            event.synchronize()
            done(buf.numpy().tobytes())
            n += 1
        return n

    @property
    def pending(self) -> int:
        return len(self._pending)
