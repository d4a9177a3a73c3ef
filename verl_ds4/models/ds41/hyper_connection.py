"""DeepSeek-V4.1 single-pass mHC: V4's mixing coefficients, V4.1's hand-over schedule.

The coefficients of one site are V4's (:class:`~verl_ds4.models.ds4.hyper_connection.DS4HyperConnection`,
same parameters and names: ``mapping_proj.weight``, ``alpha_pre`` / ``alpha_post`` / ``alpha_res``,
``bias``; the checkpoint's ``fn`` / ``scale[3]`` / ``base``). What changes is which ``pre`` collapses
the streams into a sub-layer's input. V4 computes ``pre`` from the streams a site receives and uses
it right away; V4.1 (technical report 2.4.1) uses the ``pre`` the *previous* site computed::

    pre_k, post_k, res_k = coefficients_k(x)          # from the streams entering site k
    y = F_k(sum_j carried_j x_j)                      # carried = pre_{k-1} (site 0: stream 0 only)
    x' = post_k * y + res_k^T x ;  carried <- pre_k

After the last site the streams collapse with the carried ``pre`` (no ``hc_head``): the whole model
computes one set of coefficients per site and never recomputes them for the collapse.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ds4.hyper_connection import DS4HyperConnection

__all__ = ["DS41HyperConnection", "initial_carried_pre", "collapse"]


def initial_carried_pre(leading: tuple[int, ...], n: int, dtype=None, device=None) -> torch.Tensor:
    """The ``pre`` carried into the first site: ``[..., n]`` selecting stream 0 (the embedding is
    replicated into all ``n`` streams, so this is the embedding itself)."""
    pre = torch.zeros(*leading, n, dtype=dtype, device=device)
    pre[..., 0] = 1
    return pre


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j x_j``: streams ``[..., n, h]``, ``pre`` ``[..., n]`` -> ``[..., h]``."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2)


class DS41HyperConnection(DS4HyperConnection):
    """One single-pass mHC site (around attention or the MoE)."""

    def forward(  # type: ignore[override]
        self, streams: torch.Tensor, carried_pre: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x', pre)`` for streams ``[..., n, h]`` and the previous site's ``pre`` ``[..., n]``."""
        if streams.shape[-2] != self.n or carried_pre.shape != streams.shape[:-1]:
            raise ValueError(
                f"single-pass mHC expects streams [..., {self.n}, h] and the carried pre [..., {self.n}], got "
                f"{tuple(streams.shape)} and {tuple(carried_pre.shape)}."
            )
        pre, post, res = self.mixing(streams)
        out = sublayer(collapse(streams, carried_pre))
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(res.transpose(-1, -2), streams), pre
