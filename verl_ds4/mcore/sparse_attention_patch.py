"""Put verl-ds4's memory-linear sparse attention into Megatron-LM ``dev``'s DS4 layers (``ds4.sparse_attention=linear``).

Megatron-LM ``dev``'s unfused DS4 path (``dsa_kernel_backend='none'``) calls four functions of
``megatron/core/transformer/experimental_attention_variant/csa.py`` by their module-level names:

================================================  =============================================================
Megatron-LM ``dev`` (``csa.<name>``)              replaced by (same signature, same numbers)
================================================  =============================================================
``unfused_compressed_sparse_attn``                :func:`verl_ds4.kernels.linear_sparse_attn`
``fused_qk_topk_naive`` (the indexer's top-k)     :func:`verl_ds4.kernels.chunked_qk_topk`
``_unfused_indexer_sparse_attn_from_topk`` (CP)   :func:`indexer_sparse_attn_from_topk` below: the linear core,
                                                  and for the dense indexer loss
                                                  :func:`verl_ds4.kernels.chunked_dense_indexer_kl` with
                                                  Megatron's own teacher helpers; the sparse loss stays
                                                  Megatron's (its terms are linear), over the linear core
``FusedDSAIndexerLoss`` (the CP 1 indexer top-k   :mod:`.sparse_attention_cp1`: the chunked top-k and the loss
and loss, dense or sparse)                        summed over row chunks with Megatron's own helpers
================================================  =============================================================

:func:`install` swaps those module attributes (no file of Megatron's is edited) and :func:`uninstall`
puts the originals back. Before swapping it checks that the Megatron it patches is the one the core was
proven against: each function's parameter names must be those of Megatron-LM ``dev`` at
:data:`PROVEN_COMMITS`, and a small probe (CPU, float32, with invalid ids, several sequences and padding
rows) must give the same outputs and gradients from Megatron's function and from the replacement
(``<= 1e-5`` relative; the same top-k ids). Anything else is refused with what differs and the fix
(:class:`SparseAttentionPatchError`), at start-up, before a model is built.

"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from verl_ds4.kernels import chunked_dense_indexer_kl, chunked_qk_topk, linear_sparse_attn

from verl_ds4.substitutes import megatron_dev

from .sparse_attention_cp1 import FORWARD_PARAMETERS, chunked_indexer_loss

__all__ = [
    "CSA_MODULE",
    "PROVEN_COMMITS",
    "SparseAttentionPatchError",
    "check",
    "install",
    "installed",
    "uninstall",
]

CSA_MODULE = "megatron.core.transformer.experimental_attention_variant.csa"
#: Megatron-LM ``dev`` commits whose ``csa.py`` functions the replacements were compared with (tests/): the
#: production path's proven commits (one list).
PROVEN_COMMITS = megatron_dev.PROVEN_COMMITS

#: Each replaced function's parameter names in Megatron-LM ``dev`` at :data:`PROVEN_COMMITS`.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "unfused_compressed_sparse_attn": ("query", "kv_full", "attn_sink", "topk_indices", "softmax_scale"),
    "fused_qk_topk_naive": ("q", "k", "weights", "index_topk", "mask", "varlen_starts", "varlen_ends", "key_positions", "use_relu"),
    "_unfused_indexer_sparse_attn_from_topk": (
        "query", "kv_full", "attn_sink", "topk_indices", "q_indexer", "k_indexer", "weights", "indexer_topk_indices",
        "compressed_kv", "softmax_scale", "indexer_softmax_scale", "loss_coeff", "loss_divisor", "sparse_loss", "ratio",
        "_max_seqlen_q", "indexer_layout", "q_padding_mask", "tp_group",
    ),
    "FusedDSAIndexerLoss": FORWARD_PARAMETERS,  # its forward's, after ctx (an autograd Function: csa calls .apply)
}  # fmt: skip
#: Megatron helpers the dense indexer loss calls (must exist in the same module).
HELPERS = ("_compute_unfused_csa_non_compressed_lse", "_compute_indexer_teacher_probabilities", "_normalize_indexer_teacher_target", "batch_of_row")

_FIX = (
    "use the Megatron-LM dev the GPU image pins (docker/README.md), or set ds4.sparse_attention=megatron to run "
    "Megatron's own unfused core (quadratic memory: shorter sequences or more CP)"
)


class SparseAttentionPatchError(RuntimeError):
    """The Megatron-LM in this environment cannot take the linear sparse attention (missing or different)."""


@dataclass
class _State:
    module: Any = None
    originals: dict[str, Callable] = field(default_factory=dict)


_STATE = _State()


def _csa(module=None):
    if module is not None:
        return module
    try:
        return importlib.import_module(CSA_MODULE)
    except ImportError as exc:
        raise SparseAttentionPatchError(
            f"ds4.sparse_attention=linear needs Megatron-LM dev's DS4 attention ({CSA_MODULE}), which does not import "
            f"here ({type(exc).__name__}: {exc}). Megatron-LM dev lives in the GPU image; {_FIX}."
        ) from exc


# -- the replacements ----------------------------------------------------------------------------


def _qk_topk(q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None, key_positions=None, use_relu=True):
    return chunked_qk_topk(q, k, weights, index_topk, mask, varlen_starts, varlen_ends, key_positions, use_relu)


def _indexer_sparse_attn_from_topk(csa, original):
    """The replacement of ``csa._unfused_indexer_sparse_attn_from_topk`` bound to Megatron module ``csa``."""

    def indexer_sparse_attn_from_topk(
        query, kv_full, attn_sink, topk_indices, q_indexer, k_indexer, weights, indexer_topk_indices, compressed_kv,
        softmax_scale, indexer_softmax_scale, loss_coeff, loss_divisor, sparse_loss, ratio, _max_seqlen_q,
        indexer_layout, q_padding_mask=None, tp_group=None,
    ):  # fmt: skip
        args = (query, kv_full, attn_sink, topk_indices, q_indexer, k_indexer, weights, indexer_topk_indices, compressed_kv,
                softmax_scale, indexer_softmax_scale, loss_coeff, loss_divisor, sparse_loss, ratio, _max_seqlen_q,
                indexer_layout, q_padding_mask)  # fmt: skip
        if sparse_loss:  # linear already (top-k wide); its attention call is the patched core
            return original(*args, tp_group=tp_group)
        output = linear_sparse_attn(query, kv_full, attn_sink, topk_indices, softmax_scale)
        total_q = query.shape[0]
        cu_q, cu_k, causal_offsets = indexer_layout
        window_ids = topk_indices[:, indexer_topk_indices.shape[-1] :]
        if q_padding_mask is not None:
            window_ids = window_ids.masked_fill(q_padding_mask.unsqueeze(-1), -1)
        lse = csa._compute_unfused_csa_non_compressed_lse(query, kv_full, attn_sink, window_ids, softmax_scale)

        rows = torch.arange(total_q, dtype=cu_q.dtype, device=query.device)
        q_seq = csa.batch_of_row(cu_q, total_q=total_q)
        q_pos = rows - cu_q[q_seq] + causal_offsets[q_seq]
        visible = torch.minimum(torch.div(q_pos + 1, ratio, rounding_mode="floor"), (cu_k[1:] - cu_k[:-1])[q_seq])
        q_valid = rows < cu_q[-1]
        if q_padding_mask is not None:
            q_valid = q_valid & ~q_padding_mask
        k_rows = torch.arange(k_indexer.shape[0], dtype=cu_k.dtype, device=k_indexer.device)
        k_seq = torch.bucketize(k_rows, cu_k[1:], out_int32=True, right=True).clamp_max(cu_k.shape[0] - 2)
        k_pos = k_rows - cu_k[k_seq]
        teacher_kv = compressed_kv.detach().float()
        teacher_q = query.detach()

        def valid_fn(start: int, end: int) -> torch.Tensor:
            same = q_seq[start:end].unsqueeze(1) == k_seq.unsqueeze(0)
            return same & (k_pos.unsqueeze(0) < visible[start:end].unsqueeze(1)) & q_valid[start:end].unsqueeze(1)

        def target_fn(valid: torch.Tensor, start: int, end: int) -> torch.Tensor:
            logits = torch.einsum("rhd,kd->rhk", teacher_q[start:end].float(), teacher_kv) * softmax_scale
            logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
            lse_rows = lse[:, :, start:end]
            probs = csa._compute_indexer_teacher_probabilities(logits.permute(1, 0, 2).unsqueeze(0), valid.unsqueeze(0), non_compressed_lse=lse_rows)
            target = probs.sum(dim=1).squeeze(0)
            if tp_group is not None and tp_group.size() > 1:
                torch.distributed.all_reduce(target, group=tp_group)
            return csa._normalize_indexer_teacher_target(target, lse_rows)

        raw = chunked_dense_indexer_kl(q_indexer, k_indexer, weights, indexer_softmax_scale, valid_fn, target_fn)
        if torch.is_tensor(loss_divisor):
            divisor = loss_divisor.to(device=raw.device, dtype=torch.float32).clamp_min(1.0)
        else:
            divisor = max(float(loss_divisor), 1.0)
        return output, raw * float(loss_coeff) / divisor

    return indexer_sparse_attn_from_topk


def _replacements(csa, originals: dict[str, Callable]) -> dict[str, Callable]:
    return {
        "unfused_compressed_sparse_attn": linear_sparse_attn,
        "fused_qk_topk_naive": _qk_topk,
        "_unfused_indexer_sparse_attn_from_topk": _indexer_sparse_attn_from_topk(csa, originals["_unfused_indexer_sparse_attn_from_topk"]),
        "FusedDSAIndexerLoss": chunked_indexer_loss(csa, originals["FusedDSAIndexerLoss"]),
    }


# -- the checks ----------------------------------------------------------------------------------


def _signature_problems(csa, originals: dict[str, Callable]) -> list[str]:
    problems = []
    for name, expected in SIGNATURES.items():
        fn = originals.get(name)
        if fn is None:
            problems.append(f"csa.{name} is missing")
            continue
        got = tuple(inspect.signature(fn.forward).parameters)[1:] if isinstance(fn, type) else tuple(inspect.signature(fn).parameters)
        if got != expected:
            problems.append(f"csa.{name}({', '.join(got)}) differs from the proven ({', '.join(expected)})")
    problems += [f"csa.{name} (a helper of the dense indexer loss) is missing" for name in HELPERS if not hasattr(csa, name)]
    return problems


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)) if a.numel() else 0.0


def _probe_problems(originals: dict[str, Callable], replacements: dict[str, Callable], tol: float = 1e-5) -> list[str]:
    """Run Megatron's functions and the replacements on one small CPU case each and compare."""
    from .sparse_attention_probes import PROBES

    problems = []
    for name, probe in PROBES.items():
        labels, theirs = probe(originals[name])
        _, ours = probe(replacements[name])
        for label, a, b in zip(labels, theirs, ours):
            if a.shape != b.shape:
                problems.append(f"csa.{name}: {label} has shape {tuple(a.shape)}, the linear core's {tuple(b.shape)}")
            elif not a.is_floating_point():
                if not torch.equal(a.to(torch.int64), b.to(torch.int64)):
                    problems.append(f"csa.{name}: {label} differs from the linear core's")
            elif _relative(b, a) > tol:
                problems.append(f"csa.{name}: {label} differs from the linear core's by {_relative(b, a):.1e} (relative; allowed {tol:.0e})")
    return problems


def _originals(csa) -> dict[str, Callable]:
    if _STATE.module is csa:
        return dict(_STATE.originals)
    return {name: getattr(csa, name, None) for name in SIGNATURES}


def check(csa_module=None) -> list[str]:
    """What keeps the linear core out of this Megatron (empty: it can be installed): the parameter names
    first, then (when they match) the behaviour probe of :mod:`.sparse_attention_probes`."""
    csa = _csa(csa_module)
    originals = _originals(csa)
    problems = _signature_problems(csa, originals)
    if problems:
        return problems
    return _probe_problems(originals, _replacements(csa, originals))


def install(csa_module=None) -> list[str]:
    """Replace the four functions in Megatron's ``csa`` module (idempotent). Returns the replaced names;
    raises :class:`SparseAttentionPatchError` naming what differs when :func:`check` finds anything."""
    csa = _csa(csa_module)
    if _STATE.module is csa:
        return sorted(_STATE.originals)
    problems = check(csa)
    if problems:
        raise SparseAttentionPatchError(
            "ds4.sparse_attention=linear: the Megatron-LM in this environment is not the one the linear sparse attention "
            f"was proven against (Megatron-LM dev {', '.join(c[:8] for c in PROVEN_COMMITS)}; {csa.__file__}): "
            + "; ".join(problems) + f". Fix: {_FIX}."
        )
    originals = _originals(csa)
    for name, fn in _replacements(csa, originals).items():
        setattr(csa, name, fn)
    _STATE.module, _STATE.originals = csa, originals
    return sorted(originals)


def installed(csa_module=None) -> bool:
    """Whether the linear core is in (this) Megatron ``csa`` module now."""
    return _STATE.module is not None and (csa_module is None or _STATE.module is csa_module)


def uninstall() -> None:
    """Put Megatron's own functions back (a no-op when nothing is installed)."""
    if _STATE.module is None:
        return
    for name, fn in _STATE.originals.items():
        setattr(_STATE.module, name, fn)
    _STATE.module, _STATE.originals = None, {}
