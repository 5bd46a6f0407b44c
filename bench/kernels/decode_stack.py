"""End-to-end decode tokens/s of a v41-flash-shaped stack of a few layers (bench/kernels/bandwidth.py).

The engine itself (EngineCore: scheduler, ragged forward, sampling), with random weights
made straight on the device, `batch` sequences prefilled to `context` tokens, then timed
plain decode steps (one token per sequence per step). Run once with the kernels dispatch
picks (Triton on CUDA) and once with KVMESH_KERNELS=torch, on the same device, same
weights; the ratio is the engine-level speed-up of the Triton path.

v41-flash per layer (hidden 4096, 64 heads x 512, W 128, CSA top-k 512 with a 64 x 128
indexer, FFN 11264) with the layer list cut to `layers` and a 32k vocabulary (the full
129k one would only add a bigger lm_head matmul). On CPU (--smoke) the tiny preset stands in.
"""

from __future__ import annotations

import os
import time

import torch

from services.engine.config import EngineConfig, preset
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model import weights as weights_mod


def stack_config(smoke: bool, layers: tuple[str, ...]):
    if smoke:
        return preset("tiny", name="tiny-stack", window=16, csa_m=4, hca_m=16, block_size=16,
                      csa_topk=4, head_dim=64, layers=layers)
    return preset("v41-flash", name="v41-flash-stack", layers=layers, vocab_size=32768)


def random_weights(cfg, device) -> dict[str, torch.Tensor]:
    """init_weights' scales, drawn on the device (seconds, not minutes, at this size)."""
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in weights_mod.shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            out[name] = torch.ones(shape, device=device)
        elif leaf == "sink":
            out[name] = torch.zeros(shape, device=device)
        else:
            scale = 1.0 if leaf == "embed" else 0.5 if leaf.endswith("bias") else shape[0] ** -0.5
            out[name] = torch.randn(shape, device=device, generator=g) * scale
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_tokens_per_s(cfg, weights, device, batch: int, context: int, steps: int,
                        kernels: str | None) -> float:
    """Tokens/s of `steps` plain decode steps of `batch` sequences at `context` tokens."""
    before = os.environ.get("KVMESH_KERNELS")
    if kernels is None:
        os.environ.pop("KVMESH_KERNELS", None)
    else:
        os.environ["KVMESH_KERNELS"] = kernels
    try:
        per_seq = -(-(context + steps + 8) // cfg.block_size) + 1
        engine = EngineCore(cfg, EngineConfig(
            num_slots=batch, max_running=batch, num_blocks=batch * per_seq + 8,
            max_batched_tokens=max(4096, batch), device=str(device)), weights=weights)
        g = torch.Generator().manual_seed(1)
        seqs = [engine.add_request(torch.randint(0, 256, (context,), generator=g).tolist(),
                                   SamplingParams(temperature=0, max_tokens=steps + 4,
                                                  ignore_eos=True)) for _ in range(batch)]
        while any(s.prefilling or s.slot is None for s in seqs):
            engine.step()
        engine.step()                                # warm-up decode step (compiles)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        return batch * steps / (time.perf_counter() - t0)
    finally:
        if before is None:
            os.environ.pop("KVMESH_KERNELS", None)
        else:
            os.environ["KVMESH_KERNELS"] = before


def rows(smoke: bool, device) -> list[dict]:
    """One record per batch size: tokens/s with Triton and with torch, and their ratio."""
    layers = ("swa", "csa", "swa", "hca") if smoke else ("swa", "swa", "csa", "hca")
    cfg = stack_config(smoke, layers)
    weights = random_weights(cfg, device)
    context, steps, batches = (24, 2, [2]) if smoke else (1024, 16, [1, 32, 128])
    triton = "triton" if smoke else None             # smoke: the interpreter, forced
    out = []
    for b in batches:
        tri = decode_tokens_per_s(cfg, weights, device, b, context, steps, triton)
        ref = decode_tokens_per_s(cfg, weights, device, b, context, steps, "torch")
        out.append(dict(case=f"decode_stack {len(layers)}L b={b} ctx={context}",
                        triton_tok_s=tri, torch_tok_s=ref, speedup=tri / ref))
    return out
