"""DeepSeek-V4.1 CSA2 attention on one packed sequence (CP 1), with the state shared across layers.

Roles come from :mod:`verl_ds4.ds41_facts` (Full / Reindex / Reuse, window-only for ratio 0). For
query ``i`` of a sequence (positions ``0..S-1``; ratio ``m``):

* window keys ``kv_j = RoPE_j(RMSNorm(W_kv x_j))``, ``i - W < j <= i``; queries
  ``q_i = RoPE_i(W_uq RMSNorm(W_dq x_i))`` (V4.1 has no per-head RMS on the queries, V4 has);
* a **Full** layer compresses: ratio 1 ``c_b = RMSNorm(W_kv^c x_b)``; ratio ``m > 1``
  ``c_b = RMSNorm(sum_t softmax_t(W_gate x_t) * W_kv^c x_t)`` over block ``[bm, (b+1)m)``, softmax per
  channel (no APE, no overlap, unlike V4); entries are ``RoPE_{bm}(c_b)``; index keys
  ``RoPE_{bm}(RMSNorm(W_k c_b))`` from the *unrotated* ``c_b``. Both are published in :class:`CSA2State`;
* a **Full** or **Reindex** layer scores the visible entries (``b < (i+1) // m``) with its own
  indexer queries, ``I(i, b) = sum_h w_{i,h} ReLU(qI_{i,h} . k_b)``, ``w = W_w x_i / sqrt(d_I n_I)``;
  the candidate-source layer also keeps, per query, the ``candidate_topk_blocks`` best blocks of
  ``candidate_block_size`` entries (block score = its best entry; the newest visible block always);
  a hierarchical Reindex layer ranks only inside those candidates; the top ``index_topk`` visible
  entries are selected (equal scores: lower index first). A **Reuse** layer keeps the selection;
* attention over the window keys and the selected entries with a per-head sink in the denominator,
  inverse RoPE of the output at ``i``, grouped low-rank output projection.

RoPE: plain ``rope_theta`` on window-only layers, YaRN on ``compress_rope_theta`` for every
compressing layer (ratio 1 included). Parameter names: V4's projections (Megatron-LM dev's
``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_proj``, ``kv_layernorm``,
``linear_o_group_proj``, ``linear_proj``) and dev's ``csa2`` core: ``core_attention.attn_sink``,
``core_attention.compressor.{linear_wkv, linear_wgate, norm}`` (Full; ``linear_wgate`` for m > 1),
``core_attention.indexer.{linear_wq_b, linear_weights_proj}`` (Full / Reindex) and
``{linear_wk, k_norm}`` (Full).

Packed input and contiguous CP (the V4 data contract, ``docs/ds4-context-parallel.md`` section 1):
rank ``r`` holds rows ``[r L, (r + 1) L)`` of one packed buffer described by the global
``cu_seqlens_padded``; positions restart at each sequence, blocks are counted per sequence. Each rank
takes the previous rank's last ``max(window, ratio) - 1`` rows by the left-halo P2P exchange (window
keys and blocks that straddle the boundary), makes the entries whose block ends on it, and the
entries and index keys are all-gathered (autograd-aware) over CP in sequence order; selections are
per local query.

``cache_qdq=True`` rounds the caches as the released model does (:mod:`.cache_qdq`): window KV to
FP8 after RoPE, indexer queries and keys to MXFP4, compressed KV to NVFP4 (straight-through
gradients). Off by default: the fp64 comparisons run without it (two correct fp64 computations can
round a value near a bin edge to different steps).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from verl_ds4 import ds41_facts, ds4_facts
from verl_ds4.kernels import linear_sparse_attn

from ..ds4.attention import _RMSNorm
from ..ds4.cp_comm import all_gather_rows, exchange_left_halo
from ..ds4.csa_rows import stable_top
from ..ds4.rope import apply_interleaved_rope, default_inv_freq, rope_cos_sin, yarn_inv_freq
from . import csa2_rows
from .cache_qdq import cache_qdq

__all__ = ["CSA2State", "CSA2Compressor", "CSA2Indexer", "DS41Attention", "stable_topk_mask"]


@dataclass(frozen=True)
class CSA2State:
    """What a Full layer publishes and later layers read: ``compressed_kv`` ``[W, d]`` and ``index_keys``
    ``[W, d_I]`` (rotated; every entry of the packed buffer, sequence by sequence); per local query, compact ids
    (:mod:`.csa2_rows`): ``selection`` ``[S, index_topk]``, the entries it attends to, and ``candidate_blocks``
    ``[S, candidate_topk_blocks]``, the candidate source's blocks of ``candidate_block_size`` entries, both counted
    from the query's own sequence's first entry, ascending, ``-1`` past the row's count; ``width``: ``E``, the most
    entries of any sequence."""

    ratio: int = 0
    compressed_kv: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    candidate_blocks: torch.Tensor | None = None
    width: int = 0

    @property
    def selected(self) -> torch.Tensor | None:
        """``[S, E]`` bool view of :attr:`selection` (column ``e``: the sequence's entry ``e``, :func:`.csa2_rows.own_entries`);
        ``S x E`` values, for tests and small batches (the layers read the ids)."""
        return None if self.selection is None else csa2_rows.ids_mask(self.selection, self.width)


def stable_topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask ``[R, W]`` of the ``k`` largest scores per row that are not ``-inf``, equal scores in index order
    (a stable descending sort's first ``k``, found without sorting: :func:`~verl_ds4.models.ds4.csa_rows.stable_top`)."""
    return stable_top(scores, min(k, scores.shape[-1])) & (scores > float("-inf"))


class CSA2Compressor(nn.Module):
    """One entry per complete block of ``ratio`` rows (unrotated; see the module doc)."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float, dtype=None):
        super().__init__()
        if ratio < 1:
            raise ValueError(f"a CSA2 compressor needs compress ratio >= 1, got {ratio}.")
        self.ratio = ratio
        self.linear_wkv = nn.Linear(hidden, head_dim, bias=False, dtype=dtype)
        self.linear_wgate = nn.Linear(hidden, head_dim, bias=False, dtype=dtype) if ratio > 1 else None
        self.norm = _RMSNorm(head_dim, eps, dtype=dtype)

    def forward(self, x: torch.Tensor, block_end: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[E, h]`` rows; ``block_end`` ``[W]``: the row (into ``x``) of each block's last row
        (default: consecutive blocks from row 0, a trailing incomplete block dropped) -> ``[W, head_dim]``."""
        m = self.ratio
        if block_end is None:
            block_end = torch.arange(x.shape[0] // m, device=x.device) * m + (m - 1)
        if self.linear_wgate is None:
            return self.norm(self.linear_wkv(x[block_end]))
        blocks = x[block_end.unsqueeze(1) - (m - 1) + torch.arange(m, device=x.device)]  # [W, m, h]
        weights = self.linear_wgate(blocks).softmax(dim=1)
        return self.norm((weights * self.linear_wkv(blocks)).sum(dim=1))


class CSA2Indexer(nn.Module):
    """Indexer queries (Full / Reindex) and, on a Full layer, the shared index keys."""

    def __init__(self, text: Any, owns_keys: bool, dtype=None, qdq: bool = False):
        super().__init__()
        get = _getter(text)
        self.qdq = qdq
        self.n_heads, self.head_dim = int(get("index_n_heads")), int(get("index_head_dim"))
        self.linear_wq_b = nn.Linear(int(get("q_lora_rank")), self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.linear_weights_proj = nn.Linear(int(get("hidden_size")), self.n_heads, bias=False, dtype=dtype)
        self.linear_wk = nn.Linear(int(get("head_dim")), self.head_dim, bias=False, dtype=dtype) if owns_keys else None
        self.k_norm = _RMSNorm(self.head_dim, float(get("rms_norm_eps")), dtype=dtype) if owns_keys else None

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _maybe_qdq(apply_interleaved_rope(self.k_norm(self.linear_wk(latent)), cos, sin), "mxfp4", self.qdq)

    def scores(self, x, q_r, keys, cos, sin) -> torch.Tensor:
        """``[S, E]`` unmasked scores of queries ``x`` ``[S, h]`` / ``q_r`` against keys ``[E, d_I]`` shared by the
        rows (one sequence's: :func:`.csa2_rows.choose`) or each query's own ``[S, E, d_I]``."""
        q = self.linear_wq_b(q_r).unflatten(-1, (self.n_heads, self.head_dim))
        q = _maybe_qdq(apply_interleaved_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), "mxfp4", self.qdq)
        weights = self.linear_weights_proj(x) * (self.head_dim * self.n_heads) ** -0.5
        dots = torch.einsum("shd,ed->she", q, keys) if keys.dim() == 2 else torch.einsum("shd,sed->she", q, keys)
        return (dots.relu() * weights.unsqueeze(-1)).sum(dim=1)


class _Core(nn.Module):
    """Holds dev's ``core_attention`` parameters (sink, compressor, indexer)."""

    def __init__(self, text: Any, role: ds41_facts.LayerRole, dtype=None, qdq: bool = False):
        super().__init__()
        get = _getter(text)
        self.attn_sink = nn.Parameter(torch.zeros(int(get("num_attention_heads")), dtype=dtype))
        full = role.role == ds41_facts.FULL
        self.compressor = (
            CSA2Compressor(int(get("hidden_size")), int(get("head_dim")), role.ratio, float(get("rms_norm_eps")), dtype)
            if full else None
        )  # fmt: skip
        self.indexer = CSA2Indexer(text, owns_keys=full, dtype=dtype, qdq=qdq) if role.role in (ds41_facts.FULL, ds41_facts.REINDEX) else None


class DS41Attention(nn.Module):
    """CSA2 attention of backbone layer ``layer`` of a V4.1 config (see the module doc)."""

    #: The layout protocol the engine's resolver reads (``verl_ds4.mcore.requirements``): one
    #: contiguous interval per CP rank, at least :attr:`min_local_rows` rows each.
    required_cp_partition_mode: ClassVar[str] = ds4_facts.CP_PARTITION_MODE

    def __init__(self, text: Any, layer: int, dtype=None, cache_qdq: bool = False, role: ds41_facts.LayerRole | None = None):
        super().__init__()
        self.cache_qdq = cache_qdq
        if role is None:
            nested = ds41_facts.text_config(text) is not text or "model_type" in text
            role = ds41_facts.read_config(text if nested else {"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": text}).roles[layer]
        get = _getter(text)
        self.role = role
        h, n, d = int(get("hidden_size")), int(get("num_attention_heads")), int(get("head_dim"))
        self.n_heads, self.head_dim, self.window = n, d, int(get("sliding_window"))
        self.o_groups, self.o_lora = int(get("o_groups")), int(get("o_lora_rank"))
        self.index_topk = int(get("index_topk"))
        self.candidate_blocks = int(get("candidate_topk_blocks") or 0)
        self.candidate_block_size = int(get("candidate_block_size") or 1)
        self.is_candidate_source = layer == get("candidate_source_layer_id")
        eps, q_lora = float(get("rms_norm_eps")), int(get("q_lora_rank"))
        self.linear_q_down_proj = nn.Linear(h, q_lora, bias=False, dtype=dtype)
        self.q_layernorm = _RMSNorm(q_lora, eps, dtype=dtype)
        self.linear_q_up_proj = nn.Linear(q_lora, n * d, bias=False, dtype=dtype)
        self.linear_kv_proj = nn.Linear(h, d, bias=False, dtype=dtype)
        self.kv_layernorm = _RMSNorm(d, eps, dtype=dtype)
        self.linear_o_group_proj = nn.Parameter(torch.zeros(self.o_groups * self.o_lora, n * d // self.o_groups, dtype=dtype))
        self.linear_proj = nn.Linear(self.o_groups * self.o_lora, h, bias=False, dtype=dtype)
        self.core_attention = _Core(text, self.role, dtype=dtype, qdq=cache_qdq)
        self.sparse_core: str = "dense"  # or "linear" (verl_ds4.kernels.set_sparse_core)
        # query rows per chunk of the per-query work (verl_ds4.models.query_chunks; None: a 64 MiB budget) and
        # False: each chunk's transients are kept for backward, not recomputed
        self.query_chunk_rows: int | None = None
        self.query_chunk_recompute: bool = True
        rope_dim = int(get("qk_rope_head_dim"))
        if self.role.ratio == 0:
            inv_freq = default_inv_freq(rope_dim, float(get("rope_theta")))
        else:
            yarn = get("rope_scaling") or {}
            inv_freq = yarn_inv_freq(
                rope_dim, float(get("compress_rope_theta")), float(yarn.get("factor", 1.0)),
                int(yarn.get("original_max_position_embeddings", 0) or 1), float(yarn.get("beta_fast", 32)),
                float(yarn.get("beta_slow", 1)),
            )  # fmt: skip
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def indexer_replay_width(self) -> int | None:
        """``index_topk`` of a layer with its own indexer (Full / Reindex: its choices can be replayed,
        verl_ds4.mcore.indexer_replay), else None (a Reuse layer takes its source's choice)."""
        return self.index_topk if self.role.ratio and self.core_attention.indexer is not None else None

    @property
    def min_local_rows(self) -> int:
        """Rows every CP rank must hold: the window, and a whole block of this layer's ratio."""
        return max(self.window, self.role.ratio)

    def forward(
        self,
        x: torch.Tensor,
        state: CSA2State | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, CSA2State]:
        """``x`` ``[T, h]``: this rank's rows of the packed buffer (a contiguous CP split); ``cu_seqlens_padded``
        ``[B + 1]``: the global sequence boundaries, identical on every rank (default: one sequence).
        Returns ``([T, h], the state for the next layer)``."""
        state = CSA2State() if state is None else state
        local, n, d = x.shape[0], self.n_heads, self.head_dim
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        cu = (torch.tensor([0, local * cp_size]) if cu_seqlens_padded is None else cu_seqlens_padded).to(x.device, torch.long)
        if int(cu[-1]) != local * cp_size:
            raise ValueError(f"cu_seqlens_padded[-1]={int(cu[-1])} must be local rows * CP size ({local} * {cp_size}): "
                             "pass the global boundaries, identical on every rank.")  # fmt: skip
        halo = max(self.window - 1, self.role.ratio - 1) if cp_size > 1 else 0
        if local < halo:
            raise RuntimeError(f"CSA2 under CP needs >= {halo} rows per rank (window - 1, ratio - 1), got {local}. "
                               f"Pad the packed batch to at least {cp_size} * {halo} rows.")  # fmt: skip
        xe = torch.cat((exchange_left_halo(x, halo, cp_group), x)) if halo else x
        seq_e, pos_e = _row_positions(cu, local, cp_rank, halo)
        q_seq, q_pos = seq_e[halo:], pos_e[halo:]
        cos_e, sin_e = rope_cos_sin(self.inv_freq, pos_e.clamp(min=0), x.dtype)
        cos, sin = cos_e[halo:], sin_e[halo:]
        q_r = self.q_layernorm(self.linear_q_down_proj(x))
        q = apply_interleaved_rope(self.linear_q_up_proj(q_r).unflatten(-1, (n, d)), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = _maybe_qdq(apply_interleaved_rope(self.kv_layernorm(self.linear_kv_proj(xe)), cos_e, sin_e), "fp8", self.cache_qdq)
        back = torch.arange(self.window, device=x.device)
        window_rows = (halo + torch.arange(local, device=x.device)).unsqueeze(1) - back  # [T, W]
        window_visible = back <= q_pos.unsqueeze(1)
        chosen = comp = None
        if self.role.ratio:  # each row's chosen entries as ids into the buffer's compressed KV
            state = self._compressed(x, xe, q_r, cos, sin, cu, q_seq, q_pos, cp_rank, cp_size, cp_group, state)
            chosen, comp = csa2_rows.global_ids(state.selection, cu, self.role.ratio, q_seq), state.compressed_kv
        if self.sparse_core == "linear":  # ids into [kv ; compressed KV], -1 = no key (Megatron-LM dev's layout)
            ids, kv_full = torch.where(window_visible, window_rows, -1), kv
            if chosen is not None:
                ids = torch.cat([torch.where(chosen >= 0, chosen + kv.shape[0], -1), ids], dim=1)
                kv_full = torch.cat([kv, comp])
            out = linear_sparse_attn(q, kv_full, self.core_attention.attn_sink, ids, d**-0.5).view(local, n, d)
            return self._project(out, cos, sin), state
        return self._project(csa2_rows.attend(self, q, kv, window_rows, window_visible, comp, chosen), cos, sin), state

    def attend_context(self, x: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """A DSpark stage's attention (window-only layer): queries ``x`` ``[D, h]`` over the keys of
        ``context`` ``[C, h]`` then of ``x``, at ``positions`` ``[C + D]``, where ``visible`` ``[D, C + D]``."""
        n, d, c = self.n_heads, self.head_dim, context.shape[0]
        cos_all, sin_all = rope_cos_sin(self.inv_freq, positions, x.dtype)
        cos, sin = cos_all[c:], sin_all[c:]
        q = apply_interleaved_rope(self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x))).unflatten(-1, (n, d)),
                                   cos.unsqueeze(1), sin.unsqueeze(1))  # fmt: skip
        kv = apply_interleaved_rope(self.kv_layernorm(self.linear_kv_proj(torch.cat([context, x]))), cos_all, sin_all)
        kv = _maybe_qdq(kv, "fp8", self.cache_qdq)
        return self._attend(q, kv.expand(x.shape[0], -1, -1), visible, cos, sin)

    def _attend(self, q, keys, visible, cos, sin) -> torch.Tensor:
        """:meth:`_core`, inverse RoPE, the grouped output projection -> ``[T, h]``."""
        return self._project(self._core(q, keys, visible), cos, sin)

    def _core(self, q, keys, visible) -> torch.Tensor:
        """Queries ``q`` ``[T, n, d]`` (rotated) over ``keys`` ``[T, K, d]`` (K = V) where ``visible`` ``[T, K]``, a
        per-head sink in the denominator -> ``[T, n, d]``."""
        rows, n, d = q.shape
        logits = torch.einsum("tnd,tkd->tnk", q, keys) * d**-0.5
        logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
        sink = self.core_attention.attn_sink.view(1, n, 1).expand(rows, n, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("tnk,tkd->tnd", probs, keys)

    def _project(self, out, cos, sin) -> torch.Tensor:
        """Attention output ``[T, n, d]`` -> inverse RoPE -> the grouped output projection -> ``[T, h]``."""
        rows = out.shape[0]
        out = apply_interleaved_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        grouped = out.reshape(rows, self.o_groups, -1)
        weight = self.linear_o_group_proj.view(self.o_groups, self.o_lora, -1)
        return self.linear_proj(torch.einsum("tgi,gri->tgr", grouped, weight).flatten(1))

    def _compressed(self, x, xe, q_r, cos, sin, cu, q_seq, q_pos, cp_rank, cp_size, cp_group, state: CSA2State) -> CSA2State:
        """The state after this layer, with each local query's chosen entries (``selection``, compact ids)."""
        m, core, local = self.role.ratio, self.core_attention, x.shape[0]
        block_seq, block_idx, block_end = _blocks(cu, m)
        if core.compressor is not None:
            owner = block_end // local
            mine = owner == cp_rank
            latent = core.compressor(xe, block_end[mine] - (cp_rank * local - (xe.shape[0] - local)))
            cos_b, sin_b = rope_cos_sin(self.inv_freq, block_idx[mine] * m, x.dtype)
            entries = _maybe_qdq(apply_interleaved_rope(latent, cos_b, sin_b), "nvfp4", self.cache_qdq)
            index_keys = core.indexer.keys(latent, cos_b, sin_b)
            if cp_size > 1:
                counts = torch.bincount(owner, minlength=cp_size).tolist()
                entries, index_keys = all_gather_rows(entries, counts, cp_group), all_gather_rows(index_keys, counts, cp_group)
            n_blocks = csa2_rows.entry_counts(cu, m)
            state = CSA2State(ratio=m, compressed_kv=entries, index_keys=index_keys, width=int(n_blocks.max()) if n_blocks.numel() else 0)
        elif state.compressed_kv is None or state.ratio != m:
            raise ValueError(
                f"layer {self.role.layer} (compress ratio {m}, {self.role.role}) needs the compressed KV of a Full "
                f"layer with ratio {m} before it, and the state it got has ratio {state.ratio}."
            )
        if state.compressed_kv.shape[0] != block_seq.numel():
            raise ValueError(f"layer {self.role.layer}: the shared state has {state.compressed_kv.shape[0]} entries, "
                             f"this batch makes {block_seq.numel()}: the state belongs to another batch.")  # fmt: skip
        if core.indexer is None:
            if state.selection is None:
                raise ValueError(f"Reuse layer {self.role.layer} needs a selection from a Full or Reindex layer before it.")
            return state
        selection, candidates = csa2_rows.choose(self, x.detach(), q_r.detach(), cos, sin, cu, q_seq, q_pos, state, stable_topk_mask)
        return replace(state, selection=selection, candidate_blocks=candidates)

    def _candidate_blocks(self, scores, reachable) -> torch.Tensor:
        """``[c, candidate_topk_blocks]`` ids of each query's best blocks of ``candidate_block_size`` entries
        (:attr:`CSA2State.candidate_blocks`), counted from its sequence's first entry (block score: its best
        entry; the newest visible block always), of the masked scores ``[c, E']`` over entries ``0..E'-1``."""
        entry_block = torch.arange(scores.shape[1], device=scores.device) // self.candidate_block_size  # [E']
        total = int(entry_block[-1]) + 1 if entry_block.numel() else 0
        best = scores.new_full((scores.shape[0], total), float("-inf"))
        best = best.scatter_reduce(1, entry_block.expand_as(scores), scores, reduce="amax")
        count = reachable.sum(-1)
        newest = (count - 1).clamp(min=0) // self.candidate_block_size
        best = best.masked_fill((torch.arange(total, device=scores.device) == newest.unsqueeze(1)) & (count > 0).unsqueeze(1), float("inf"))
        return csa2_rows.compact(stable_topk_mask(best, self.candidate_blocks), self.candidate_blocks)

    def _candidate_mask(self, blocks, width: int) -> torch.Tensor:
        """``[c, width]`` bool: the entries ``0..width-1`` inside the candidate blocks ``blocks`` ``[c, K]``."""
        entry_block = torch.arange(width, device=blocks.device) // self.candidate_block_size
        total = -(-width // self.candidate_block_size)
        return csa2_rows.ids_mask(blocks, total).gather(1, entry_block.expand(blocks.shape[0], width))


def _row_positions(cu: torch.Tensor, local: int, rank: int, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and in-sequence position of this rank's rows and its ``halo`` rows before them
    (position -1 before the buffer start)."""
    rows = torch.arange(rank * local - halo, (rank + 1) * local, device=cu.device)
    seq = torch.bucketize(rows.clamp(min=0), cu[1:], right=True)
    pos = torch.where(rows >= 0, rows - cu[seq.clamp(max=cu.numel() - 2)], -1)
    return seq, pos


def _blocks(cu: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every complete block of ``m`` rows in the buffer, sequence by sequence: its sequence, its index
    in the sequence and the global row of its last row (a trailing incomplete block is none)."""
    n_blocks = csa2_rows.entry_counts(cu, m)
    block_seq = torch.repeat_interleave(torch.arange(n_blocks.numel(), device=cu.device), n_blocks)
    block_idx = torch.arange(block_seq.numel(), device=cu.device) - csa2_rows.first_entries(cu, m)[block_seq]
    return block_seq, block_idx, cu[block_seq] + block_idx * m + (m - 1)


def _maybe_qdq(values: torch.Tensor, fmt: str, on: bool) -> torch.Tensor:
    return cache_qdq(values, fmt) if on else values


def _getter(text: Any):
    return lambda key: ds41_facts.text_value(text, key)
