"""Which torch device an engine runs on: `--device auto|cpu|cuda|cuda:N` (EngineConfig.device).

`auto` (the default) is CUDA when torch sees a GPU, else the CPU. Asking for CUDA where
there is none is a start-up error that names the flag, not a crash at the first forward.
Weights, the state pool, the block store, the replica area and the runner's window mirror and
per-step index tensors live on this device (EngineCore places them); the host snapshot store
stays in host memory.
"""

from __future__ import annotations

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
