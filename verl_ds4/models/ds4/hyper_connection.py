"""DS4's manifold-constrained hyper-connections (mHC): ``n = hc_mult`` residual streams per token.

Every decoder layer keeps the residual as ``n`` streams ``x [..., n, h]`` and wraps each sub-layer
``F`` (attention, MoE) in one :class:`DS4HyperConnection`::

    z      = RMS(flatten(x))                      # weightless, eps = rms_norm_eps inside the sqrt
    m      = mapping_proj(z)                      # n (pre) + n (post) + n*n (res) mixing logits
    pre    = sigmoid(alpha_pre  * m_pre  + b_pre) + hc_eps                    # [.., n]
    post   = 2 * sigmoid(alpha_post * m_post + b_post)                       # [.., n], in (0, 2)
    res    = Sinkhorn(alpha_res * m_res + b_res, hc_sinkhorn_iters, hc_eps)   # [.., n, n]
    y      = F(sum_j pre_j x_j)
    x'_k   = post_k * y + sum_j res[j, k] * x_j

Sinkhorn: a row softmax plus ``hc_eps``, a column normalisation, then ``iters - 1`` (row, column)
normalisation pairs, each denominator ``+ hc_eps`` (so ``res`` is only approximately doubly
stochastic). :class:`DS4HyperHead` collapses the streams once before the final norm with its own
sigmoid weights ``pre``.

Numerics follow transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` (5.10.4),
computed in the streams' dtype (transformers computes the mixing in float32; at fp64 the two agree
once its float32 steps are promoted, see :mod:`.hf_reference`). Megatron-LM ``dev``'s
``HyperConnectionModule`` differs in one place we do *not* follow: its RMS is
``x / (||x|| / sqrt(K) + eps)`` (eps outside the square root); ours is ``x * rsqrt(mean(x^2) + eps)``
as transformers and DeepSeek's reference code. Parameter names are dev's: ``mapping_proj.weight``
``[n*n + 2n, n*h]`` (rows: pre, post, res), ``alpha_pre`` / ``alpha_post`` / ``alpha_res`` ``[1]``,
``bias`` ``[n*n + 2n]``; the HF checkpoint's ``fn`` / ``base`` / ``scale[3]`` map onto them
(:mod:`.hf_checkpoint`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["sinkhorn", "DS4HyperConnection", "DS4HyperHead", "unweighted_rms"]


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)`` in ``x``'s dtype."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """transformers' / DeepSeek's Sinkhorn projection of ``[..., n, n]`` logits (``iters >= 1``)."""
    if iters < 1:
        raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {iters}.")
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class DS4HyperConnection(nn.Module):
    """One mHC site (around attention or around the MoE) for ``n`` streams of width ``hidden``."""

    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, dtype=None):
        super().__init__()
        if n < 1:
            raise ValueError(f"hc_mult must be >= 1, got {n}.")
        self.n, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        mix = n * n + 2 * n
        self.mapping_proj = nn.Linear(n * hidden, mix, bias=False, dtype=dtype)
        self.alpha_pre = nn.Parameter(torch.ones(1, dtype=dtype))
        self.alpha_post = nn.Parameter(torch.ones(1, dtype=dtype))
        self.alpha_res = nn.Parameter(torch.ones(1, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(mix, dtype=dtype))

    def mixing(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams ``[..., n, h]`` -> ``(pre [..., n], post [..., n], res [..., n, n])``."""
        n = self.n
        mixes = self.mapping_proj(unweighted_rms(streams.flatten(-2), self.norm_eps))
        m_pre, m_post, m_res = mixes.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_res = self.bias.split([n, n, n * n])
        pre = torch.sigmoid(m_pre * self.alpha_pre + b_pre) + self.hc_eps
        post = 2 * torch.sigmoid(m_post * self.alpha_post + b_post)
        res_logits = m_res.unflatten(-1, (n, n)) * self.alpha_res + b_res.view(n, n)
        return pre, post, sinkhorn(res_logits, self.sinkhorn_iters, self.hc_eps)

    def forward(self, streams: torch.Tensor, sublayer) -> torch.Tensor:
        """``x' = post * sublayer(sum_j pre_j x_j) + res^T x`` for streams ``[..., n, h]``."""
        if streams.shape[-2] != self.n:
            raise ValueError(f"mHC expects {self.n} residual streams in dim -2, got shape {tuple(streams.shape)}.")
        pre, post, res = self.mixing(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2)
        out = sublayer(collapsed)
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(res.transpose(-1, -2), streams)


class DS4HyperHead(nn.Module):
    """Final collapse of ``n`` streams: ``sum_j (sigmoid(scale * head_fn(RMS(x)) + base)_j + hc_eps) x_j``."""

    def __init__(self, hidden: int, n: int, hc_eps: float, norm_eps: float, dtype=None):
        super().__init__()
        self.n, self.hc_eps, self.norm_eps = n, hc_eps, norm_eps
        self.head_fn = nn.Parameter(torch.zeros(n, n * hidden, dtype=dtype))
        self.base = nn.Parameter(torch.zeros(n, dtype=dtype))
        self.scale = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams ``[..., n, h]`` -> ``[..., h]``."""
        mixes = F.linear(unweighted_rms(streams.flatten(-2), self.norm_eps), self.head_fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2)
