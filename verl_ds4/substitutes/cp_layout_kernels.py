"""CPU (any-device) stand-ins for the two CuTe-DSL kernels of Megatron-LM ``dev``'s DeepSeek-V4 context-parallel
attention (``megatron/core/transformer/experimental_attention_variant/csa_utils/cp_layout_kernels.py``).

Under CP > 1, ``cp_utils.prepare_cp_compressor_input`` calls ``cp_layout_kernels.CompressorInputCompact.apply`` and
``csa.py`` (``_forward_thd_cp``, window-only layers included) calls ``cp_layout_kernels.build_attention_indices``;
both look the name up on the module at call time, and both raise for tensors that are not CUDA. :func:`install`
replaces those two module attributes by dispatchers: CUDA tensors go to Megatron's originals unchanged, any other
device to the functions below. Written from the documented contract; the proof is
``tests/test_cp_layout_kernels_cpu_on_cpu.py`` (equal to the pure-PyTorch references of Megatron's own test file).

Common terms. A CP rank owns the global THD rows ``[global_start, global_start + l_local)``; ``cu_seqlens``
(``n_seq + 1`` non-decreasing offsets, padded layout) splits all rows into sequences; rows past ``cu_seqlens[-1]``
are padding. ``boundary_hidden`` / the first ``d_window`` rows of the rank's KV buffer hold the global rows
``[global_start - d_window, global_start)``; the buffer is ``[boundary (d_window) ; local (l_local) ; compressed
rank-major rows]``, so global row ``p`` of the window is buffer row ``p - global_start + d_window`` and rank-major
compressed row ``r`` is buffer row ``d_window + l_local + r``. A sequence's compressed group ``c`` is its tokens
``[c * ratio, (c + 1) * ratio)``; only full groups exist (``cu_seqlens_compressed`` = prefix sums of
``len // ratio``).

:func:`compressor_input_compact` ``(hidden_local (l_local, ...), boundary_hidden (d_window, ...), cu_seqlens,
global_start, ratio, d_comp, c_cap) -> (hidden_compact (c_cap * ratio, ...) same dtype, comp_ids int32 (c_cap,))``
    For each sequence with at least one row on this rank, in order, its groups ``c`` with
    ``c * ratio >= global_start - d_comp - seq_start`` (first token not left of the compressor's look-back) and
    ``(c + 1) * ratio <= min(seq_end, global_end) - seq_start`` (complete on or before this rank), in order: their
    ``ratio`` token rows (from ``boundary_hidden`` left of ``global_start``, else ``hidden_local``) fill the next
    ``ratio`` rows of ``hidden_compact`` and ``c`` the next slot of ``comp_ids``. Slots past the last group (or
    past ``c_cap``, which truncates) hold zero rows and id -1. Differentiable: the gradient of a source row is the
    gradient of the compact row it was copied to (zero where none).

:func:`build_attention_indices` ``(cu_seqlens, global_start, l_local, d_window, window_size, ratio,
compressed_width, compressed_topk=None, cu_seqlens_compressed=None, seq_to_rank_row=None, for_indexer_loss=False)
-> (topk_idxs int32 (l_local, window_size + compressed_width), topk_length int32 (l_local,) or None,
indexer_rank_major int32 (l_local, compressed_width) or None)``
    For a query at global row ``q`` of a sequence starting at ``s``: the window is the rows
    ``max(q - window_size + 1, s) .. q`` (as buffer rows). A compressed id ``c`` of that sequence is valid when
    ``0 <= c < its compressed length`` (0 when ``ratio <= 1`` or ``compressed_width == 0``), its sequence-major row
    ``m = cu_seqlens_compressed[seq] + c`` is inside ``seq_to_rank_row`` (None: an empty map) and
    ``seq_to_rank_row[m] >= 0``; it lowers to ``d_window + l_local + seq_to_rank_row[m]``. Unused entries are -1.

    * ``compressed_topk`` given (selected ids, ``(l_local, >= compressed_width)``): window rows first, then the
      valid selected ids in their column order, packed; ``topk_length`` counts both.
    * ``compressed_topk`` None (every visible group): window rows first, then ids ``0 .. k-1`` with
      ``k = min((q - s + 1) // ratio, compressed_width, compressed length)``, each in its own column (an id whose
      map entry is invalid stays -1 in place, as the CUDA kernel does); ``topk_length`` = window + ``k``.
    * ``for_indexer_loss`` (needs ``compressed_topk``): column ``j < compressed_width`` is selected id ``j`` lowered
      (or -1), the window follows from column ``compressed_width``; ``indexer_rank_major[row, j]`` is the map entry
      of a valid-range id (-1 otherwise); no ``topk_length``.

    Padding rows: all -1, except outside indexer-loss mode, where column 0 is 0 with length 1 (fused attention
    needs one in-range key), when the width is not zero.
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

__all__ = ["build_attention_indices", "compressor_input_compact", "install", "installed", "uninstall"]

#: The names of Megatron's module this patch replaces (csa.py and cp_utils.py call them as module attributes).
PATCHED_NAMES = ("CompressorInputCompact", "build_attention_indices")


def _at_least_one_sequence(cu: torch.Tensor) -> torch.Tensor:
    """Offsets of no sequence read as one empty sequence (the same rows)."""
    return cu if cu.shape[0] > 1 else torch.cat((cu, cu)) if cu.shape[0] else cu.new_zeros(2)


def _div_floor(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="floor")


def _visible_groups(cu: torch.Tensor, global_start: int, l_local: int, ratio: int, d_comp: int):
    """Per sequence: the first visible group and how many (0 for a sequence with no row on this rank)."""
    starts, ends = cu[:-1], cu[1:]
    local_end = ends.clamp_max(global_start + l_local)
    present = starts.clamp_min(global_start) < local_end
    first = _div_floor((global_start - d_comp - starts).clamp_min(0) + ratio - 1, ratio)
    stop = _div_floor(local_end - starts, ratio)
    count = torch.where(present, (stop - first).clamp_min(0), torch.zeros_like(first))
    return first, count


def compressor_input_compact(hidden_local: torch.Tensor, boundary_hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                             global_start: int, ratio: int, d_comp: int, c_cap: int,
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather the compressor's input groups of this rank (contract in the module docstring)."""
    global_start, ratio, d_comp, c_cap = int(global_start), int(ratio), int(d_comp), int(c_cap)
    l_local, d_window = hidden_local.shape[0], boundary_hidden.shape[0]
    device = hidden_local.device
    cu = _at_least_one_sequence(cu_seqlens.to(device=device, dtype=torch.int64))
    first, count = _visible_groups(cu, global_start, l_local, ratio, d_comp)
    ends = torch.cumsum(count, 0)
    slots = torch.arange(c_cap, device=device)
    seq = torch.searchsorted(ends, slots, right=True).clamp_max(count.shape[0] - 1)
    valid = slots < ends[-1]
    comp = first[seq] + slots - (ends - count)[seq]
    comp_ids = torch.where(valid, comp, -1).to(torch.int32)
    # token rows of each slot's group, as rows of [boundary ; local ; one zero row]
    tokens = (cu[:-1][seq] + comp * ratio).unsqueeze(1) + torch.arange(ratio, device=device)
    zero_row = d_window + l_local
    rows = torch.where(valid.unsqueeze(1), tokens - global_start + d_window, zero_row).reshape(-1)
    width = math.prod(hidden_local.shape[1:])
    source = torch.cat((boundary_hidden.reshape(d_window, width).to(hidden_local.dtype),
                        hidden_local.reshape(l_local, width), hidden_local.new_zeros((1, width))))
    compact = source.index_select(0, rows).reshape((c_cap * ratio,) + tuple(hidden_local.shape[1:]))
    return compact, comp_ids


def build_attention_indices(cu_seqlens: torch.Tensor, global_start: int, l_local: int, d_window: int,
                            window_size: int, ratio: int, compressed_width: int,
                            compressed_topk: Optional[torch.Tensor] = None,
                            cu_seqlens_compressed: Optional[torch.Tensor] = None,
                            seq_to_rank_row: Optional[torch.Tensor] = None, for_indexer_loss: bool = False,
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Lower window rows and compressed ids to rows of the rank's KV buffer (contract in the module docstring)."""
    if for_indexer_loss and compressed_topk is None:
        raise RuntimeError("DSv4 CP indexer-loss indices require compressed_topk.")
    global_start, l_local, d_window = int(global_start), int(l_local), int(d_window)
    window_size, ratio, width_c = int(window_size), int(ratio), int(compressed_width)
    device = cu_seqlens.device
    cu = _at_least_one_sequence(cu_seqlens.to(torch.int64))
    cu_comp = cu if cu_seqlens_compressed is None else _at_least_one_sequence(
        cu_seqlens_compressed.to(device=device, dtype=torch.int64))
    n_seq = cu.shape[0] - 1
    total = window_size + width_c

    q = torch.arange(global_start, global_start + l_local, device=device)
    seq = torch.searchsorted(cu[1:].contiguous(), q, right=True).clamp_max(n_seq - 1)
    found = (q >= cu[seq]) & (q < cu[seq + 1])
    seq_start = cu[seq]
    win_first = torch.maximum(q - window_size + 1, seq_start)
    win_count = torch.where(found, q - win_first + 1, 0)
    compressing = ratio > 1 and width_c > 0
    comp_len = torch.where(found, cu_comp[seq + 1] - cu_comp[seq], 0) if compressing else torch.zeros_like(q)
    comp_base = cu_comp[seq] if compressing else torch.zeros_like(q)
    rank_map = (seq_to_rank_row.to(device=device, dtype=torch.int64) if seq_to_rank_row is not None
                else torch.empty(0, dtype=torch.int64, device=device))
    lowered_base = d_window + l_local
    if compressed_topk is not None and compressed_topk.shape[-1] < width_c:
        raise RuntimeError(f"compressed_topk has {compressed_topk.shape[-1]} columns, fewer than "
                           f"compressed_width={width_c}.")

    def lower(ids: torch.Tensor):
        """Map logical ids (l_local, k) to (rank-major row or -1, id usable); the row is -1 unless in range."""
        in_range = (ids >= 0) & (ids < comp_len.unsqueeze(1))
        major = comp_base.unsqueeze(1) + ids
        in_range &= major < rank_map.shape[0]
        rank_row = rank_map[torch.where(in_range, major, 0)] if rank_map.numel() else torch.zeros_like(ids)
        rank_row = torch.where(in_range, rank_row, -1)
        return rank_row, in_range & (rank_row >= 0)

    cols = torch.arange(window_size, device=device)
    window_rows = win_first.unsqueeze(1) + cols - global_start + d_window
    window_ok = cols < win_count.unsqueeze(1)
    out = torch.full((l_local, total), -1, dtype=torch.int64, device=device)

    if for_indexer_loss:
        ids = compressed_topk[:, :width_c].to(device=device, dtype=torch.int64)
        rank_row, ok = lower(ids)
        out[:, :width_c] = torch.where(ok, lowered_base + rank_row, -1)
        out[:, width_c:] = torch.where(window_ok, window_rows, -1)
        rank_major = torch.full(tuple(compressed_topk.shape), -1, dtype=torch.int32, device=device)
        rank_major[:, :width_c] = rank_row.to(torch.int32)
        return out.to(torch.int32), None, rank_major

    out[:, :window_size] = torch.where(window_ok, window_rows, -1)
    if compressed_topk is not None:  # selected ids, the valid ones packed after the window
        ids = compressed_topk[:, :width_c].to(device=device, dtype=torch.int64)
        rank_row, ok = lower(ids)
        dest = win_count.unsqueeze(1) + torch.cumsum(ok.to(torch.int64), 1) - 1
        dest = torch.where(ok, dest, total)  # a spare column takes the invalid ones
        spare = torch.cat((out, out.new_full((l_local, 1), -1)), 1)
        spare.scatter_(1, dest, torch.where(ok, lowered_base + rank_row, -1))
        out = spare[:, :total]
        length = win_count + ok.sum(1)
    else:  # every visible group, each in its own column
        k = torch.minimum(_div_floor(q - seq_start + 1, max(ratio, 1)).clamp_max(width_c), comp_len)
        k = torch.where(found, k, 0) if compressing else torch.zeros_like(q)
        j = torch.arange(width_c, device=device).expand(l_local, width_c)
        rank_row, ok = lower(torch.where(j < k.unsqueeze(1), j, -1))
        out.scatter_(1, win_count.unsqueeze(1) + j, torch.where(ok, lowered_base + rank_row, -1))
        length = win_count + k
    if total > 0:  # padding rows: one in-range dummy key
        out[:, 0] = torch.where(found, out[:, 0], 0)
        length = torch.where(found, length, 1)
    return out.to(torch.int32), length.to(torch.int32), None


# ---------------------------------------------------------------------------------------------------- the patch

_ORIGINALS: dict = {}  # (module name, attribute) -> the original object


def _on_cuda(*tensors) -> bool:
    return all(t is None or t.is_cuda for t in tensors)


def _make_dispatchers(original_compact, original_indices):
    class CompressorInputCompact:
        """Dispatcher: Megatron's CuTe-DSL autograd function for CUDA tensors, :func:`compressor_input_compact`
        (differentiable by autograd) for any other device."""

        megatron_original = original_compact

        @staticmethod
        def apply(hidden_local, boundary_hidden, cu_seqlens, global_start, ratio, d_comp, c_cap):
            if _on_cuda(hidden_local, boundary_hidden, cu_seqlens):
                return original_compact.apply(hidden_local, boundary_hidden, cu_seqlens, global_start, ratio,
                                              d_comp, c_cap)
            return compressor_input_compact(hidden_local, boundary_hidden, cu_seqlens, global_start, ratio,
                                            d_comp, c_cap)

    def dispatch_build_attention_indices(cu_seqlens, global_start, l_local, d_window, window_size, ratio,
                                         compressed_width, compressed_topk=None, cu_seqlens_compressed=None,
                                         seq_to_rank_row=None, for_indexer_loss=False):
        fn = original_indices if _on_cuda(cu_seqlens, compressed_topk, cu_seqlens_compressed,
                                           seq_to_rank_row) else build_attention_indices
        return fn(cu_seqlens, global_start, l_local, d_window, window_size, ratio, compressed_width,
                  compressed_topk, cu_seqlens_compressed=cu_seqlens_compressed, seq_to_rank_row=seq_to_rank_row,
                  for_indexer_loss=for_indexer_loss)

    dispatch_build_attention_indices.megatron_original = original_indices
    dispatch_build_attention_indices.__name__ = "build_attention_indices"
    return {"CompressorInputCompact": CompressorInputCompact,
            "build_attention_indices": dispatch_build_attention_indices}


def installed(kernels_module) -> bool:
    return getattr(getattr(kernels_module, "build_attention_indices", None), "megatron_original", None) is not None


def install(kernels_module) -> list:
    """Replace :data:`PATCHED_NAMES` on Megatron's ``cp_layout_kernels`` module, and any ``from ... import``
    binding of them in an imported ``megatron`` module (none at the proven commits). Returns the replaced
    ``module.attribute`` names. Installing twice is a no-op."""
    if installed(kernels_module):
        return sorted(key[0] + "." + key[1] for key in _ORIGINALS)
    originals = {name: getattr(kernels_module, name) for name in PATCHED_NAMES}
    replacements = _make_dispatchers(originals["CompressorInputCompact"], originals["build_attention_indices"])
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "megatron" or module_name.startswith("megatron.")):
            continue
        for attr, value in list(vars(module).items()):
            for name, original in originals.items():
                if value is original:
                    _ORIGINALS[(module_name, attr)] = original
                    setattr(module, attr, replacements[name])
    return sorted(key[0] + "." + key[1] for key in _ORIGINALS)


def uninstall() -> None:
    """Put every replaced attribute back."""
    for (module_name, attr), original in list(_ORIGINALS.items()):
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, attr, original)
        del _ORIGINALS[(module_name, attr)]
