"""Row chunks of the CPU models' per-query attention work: memory O(rows x chunk), not O(rows x blocks).

The DS4 CSA / HCA layer and V4.1's CSA2 layer score every query row against the compressed blocks
(entries) of the buffer: the indexer's scores, its top-k, the visibility masks, the dense core's logits
and the indexer loss are ``[T, NB]`` (times heads) per layer, and autograd would keep them all for
backward. Every one of those quantities is row-local (a row's output, choice and loss term depend on
that row's query and the shared keys only), so the layers compute them ``chunk`` query rows at a time:

* the choices (no gradient: the indexer's top-k and the replay) as compact ids, chunk by chunk;
* the differentiable part (the attention over the window and the chosen blocks, the indexer's KL term)
  of each chunk under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): only the chunk's inputs
  are kept, and backward recomputes the chunk's ``[chunk, heads, NB]`` tensors.

Row by row the numbers are the same operations as over all rows at once (only sums over rows, the
indexer loss and the parameters' gradients, are added chunk by chunk).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["QUERY_CHUNK_BYTES", "chunk_bounds", "query_chunk_rows", "run_rows"]

#: Work space of one chunk's ``[chunk, heads, NB]`` tensors (forward, or one chunk's recompute in backward).
QUERY_CHUNK_BYTES = 64 * 1024**2


def query_chunk_rows(keys: int, heads: int, itemsize: int, fixed: int | None = None, budget_bytes: int = QUERY_CHUNK_BYTES) -> int:
    """Query rows per chunk: ``fixed`` when given (tests, ``verify --seq-len``), else what ``budget_bytes`` holds
    for about eight ``[rows, heads, keys]`` tensors of ``itemsize`` bytes (logits, probabilities, masks, their gradients)."""
    if fixed is not None:
        if int(fixed) < 1:
            raise ValueError(f"query_chunk_rows must be a positive number of rows, got {fixed}.")  # error-catalogue: internal: tests and verify pass a positive count
        return int(fixed)
    per_row = 8 * max(heads, 1) * max(keys, 1) * itemsize
    return max(1, int(budget_bytes) // per_row)


def chunk_bounds(rows: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(rows)`` in steps of ``chunk``."""
    return [(s, min(s + chunk, rows)) for s in range(0, rows, chunk)]


def run_rows(fn: Callable, *tensors: torch.Tensor | None):
    """``fn(*tensors)``, under a non-reentrant checkpoint when autograd would record it (its transients are
    recomputed in backward instead of kept)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return checkpoint(fn, *tensors, use_reentrant=False)
    return fn(*tensors)
