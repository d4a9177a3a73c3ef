"""The two collectives DS4 attention needs under contiguous context parallelism, as autograd Functions.

* :func:`exchange_left_halo`: rank ``r`` receives the last ``rows`` rows of rank ``r - 1``
  (rank 0 receives zeros). Backward sends the halo's gradient back to rank ``r - 1``, which adds
  it to the gradient of its last ``rows`` rows. Point-to-point inside the CP group.
* :func:`all_gather_rows`: every rank contributes a variable number of rows (the compressed KV
  blocks or indexer keys it owns; the counts are known on every rank without communication) and
  receives all of them in rank order. Backward sums the gradient over the group and returns each
  rank its own slice (a reduce-scatter; written as all-reduce + slice because gloo has no
  reduce-scatter).

* :func:`next_rank_first_row`: rank ``r`` receives row 0 of rank ``r + 1`` (the last rank receives
  zeros); not differentiable (MTP rolls token ids, labels and masks with it).

All work on any backend with point-to-point and all-gather support (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["exchange_left_halo", "all_gather_rows", "next_rank_first_row"]


def _p2p(send: torch.Tensor | None, send_to: int | None, recv: torch.Tensor | None, recv_from: int | None, group) -> None:
    """Post the (optional) send and receive, then wait for both. Ranks are ranks inside ``group``."""
    works = []
    if recv is not None:
        works.append(dist.irecv(recv, group=group, group_src=recv_from))
    if send is not None:
        works.append(dist.isend(send.contiguous(), group=group, group_dst=send_to))
    for work in works:
        work.wait()


class _LeftHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, group) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if x.shape[0] < rows:
            raise RuntimeError(
                f"DS4 CP boundary exchange requires local rows >= D_window: local_rows={x.shape[0]}, "
                f"D_window={rows}. Pad the packed batch to at least cp_size * {rows} rows "
                f"(PlanOptions(min_local_rows={rows}))."
            )
        ctx.rows, ctx.group, ctx.rank, ctx.size, ctx.shape = rows, group, rank, size, x.shape
        halo = x.new_zeros((rows,) + tuple(x.shape[1:]))
        _p2p(
            send=x[-rows:] if rank < size - 1 else None,
            send_to=rank + 1,
            recv=halo if rank > 0 else None,
            recv_from=rank - 1,
            group=group,
        )
        return halo

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):
        rows, rank, size = ctx.rows, ctx.rank, ctx.size
        from_right = grad_halo.new_zeros((rows,) + tuple(ctx.shape[1:]))
        _p2p(
            send=grad_halo if rank > 0 else None,
            send_to=rank - 1,
            recv=from_right if rank < size - 1 else None,
            recv_from=rank + 1,
            group=ctx.group,
        )
        grad_x = grad_halo.new_zeros(ctx.shape)
        grad_x[-rows:] = from_right
        return grad_x, None, None


def exchange_left_halo(x: torch.Tensor, rows: int, group) -> torch.Tensor:
    """Rows ``[-rows:]`` of the previous CP rank's ``x`` (zeros on rank 0); differentiable."""
    return _LeftHalo.apply(x, rows, group)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], group) -> torch.Tensor:
        rank = dist.get_rank(group)
        if x.shape[0] != counts[rank]:
            raise RuntimeError(f"all_gather_rows: rank {rank} holds {x.shape[0]} rows but counts say {counts[rank]}.")
        ctx.counts, ctx.group, ctx.rank = counts, group, rank
        width = max(counts)
        if width == 0:
            return x.new_zeros((0,) + tuple(x.shape[1:]))
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, rank = ctx.counts, ctx.rank
        start = sum(counts[:rank])
        if max(counts) == 0:
            return grad.new_zeros((0,) + tuple(grad.shape[1:])), None, None
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[start : start + counts[rank]], None, None


def all_gather_rows(x: torch.Tensor, counts: Sequence[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (rank ``r`` holds ``counts[r]`` rows) in rank order; differentiable."""
    return _AllGatherRows.apply(x, tuple(int(c) for c in counts), group)


def next_rank_first_row(x: torch.Tensor, group) -> torch.Tensor:
    """Row 0 of the next CP rank's ``x`` (zeros on the last rank), shape ``x.shape[1:]``; no autograd.

    The one-row left roll of a contiguous CP split: a rank's last row's successor is the next rank's
    first row. Rank ``r > 0`` sends its row 0 to ``r - 1``.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[0] < 1:
        raise RuntimeError("next_rank_first_row: every CP rank must hold at least one row.")
    recv = x.new_zeros(x.shape[1:])
    _p2p(
        send=x[0].detach() if rank > 0 else None,
        send_to=rank - 1,
        recv=recv if rank < size - 1 else None,
        recv_from=rank + 1,
        group=group,
    )
    return recv
