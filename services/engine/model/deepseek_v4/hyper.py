"""Manifold-constrained hyper-connections: the residual as `hc_mult` streams.

Before each sub-block (attention, then MoE) the streams give three sets of weights:
`pre` collapses them into the sub-block's input, `post` spreads its output back over the
streams, and `comb` (made doubly stochastic by Sinkhorn iterations) mixes the old streams in.
There is no other residual. `hc_head` collapses the streams once more before the final norm.

Shapes: streams [S, n, D]; pre, post [S, n]; comb [S, n, n] (row = input stream).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.numerics import unit_rms_norm


def mix_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                iters: int, hc_eps: float, rms_eps: float, work: torch.dtype = torch.float32):
    """(pre, post, comb) for one sub-block. The projection runs in `work` (fp32 as V4's
    reference; V4.1's float64 models pass float64); adding `base` promotes to the
    parameters' dtype, where sigmoid, softmax and Sinkhorn run."""
    n = streams.shape[-2]
    flat = unit_rms_norm(streams.flatten(-2).to(work), rms_eps, work)
    mixes = F.linear(flat, fn.to(work))
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)  # Sinkhorn starts on columns
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[S, n, D] -> [S, D]: the sub-block's input."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
           comb: torch.Tensor) -> torch.Tensor:
    """New streams: X'_k = post_k * out + sum_j comb[j, k] * X_j."""
    dtype = streams.dtype
    return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
            + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


def head_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  hc_eps: float, rms_eps: float) -> torch.Tensor:
    """The final collapse (`hc_head`): sigmoid weights in fp32, no Sinkhorn, no post."""
    flat = unit_rms_norm(streams.flatten(-2).float(), rms_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return collapse(streams, pre)
