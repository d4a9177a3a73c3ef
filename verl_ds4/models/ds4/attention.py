"""A pure-PyTorch DeepSeek-V4 hybrid attention (sliding window + CSA + HCA) for packed THD input.

This is the CPU-runnable reference of DS4's attention (math: docs/ds4-context-parallel.md section 2)
that obeys the same data contract as Megatron-LM's ``DSv4HybridAttention`` under context parallelism:

* input rows are one global packed buffer split **contiguously** over the CP group: rank ``r`` holds
  global rows ``[r * L, (r + 1) * L)``; positions come from ``global_start = r * L`` and the global
  ``cu_seqlens_padded`` (position ids are ignored);
* the left neighbour's last ``min_local_rows`` rows arrive by a point-to-point halo exchange (for the
  sliding window and for compression blocks that straddle the rank boundary);
* each rank compresses the blocks whose last row it holds, then the compressed KV (and, for CSA,
  the indexer keys) are all-gathered over the group.

One layer has a compression ratio ``m``: 0 (sliding window only), 4 (CSA: overlapping ratio-4
compression + top-k lightning indexer) or 128 (HCA: every completed ratio-128 block). The indexer
reads detached inputs and top-k is not differentiable, so the indexer's parameters get no gradient
from the language-model loss; with ``indexer_loss_coeff > 0`` (Megatron's ``dsa_indexer_loss_coeff``)
a training forward adds DS4's auxiliary KL loss (:mod:`.indexer_loss`), attached to the output's
gradient with Megatron-Core's ``DSAIndexerLossAutoScaler`` and kept in ``last_indexer_loss``.

Top-k ties: candidates with equal indexer score are taken in block order (a stable sort), so the
selection is deterministic and independent of the CP size. ``torch.topk`` (used by transformers)
does not specify an order among ties; the two agree whenever the k-th and (k+1)-th scores differ.

Shapes: ``T`` packed rows on this rank, ``h`` hidden size, ``n`` heads, ``d`` head dim, ``r`` rope dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from verl_ds4 import ds4_facts


from .cp_comm import all_gather_rows, exchange_left_halo
from .csa_rows import Selection, attend_rows, block_ids, choose
from .rope import apply_interleaved_rope, default_inv_freq, rope_cos_sin, yarn_inv_freq

__all__ = ["DS4AttentionSpec", "DS4HybridAttention", "block_ids", "layer_kind_for_ratio", "CSA_RATIO"]

CSA_RATIO = ds4_facts.CSA_RATIO
LayerKind = Literal["sliding", "csa", "hca"]


def layer_kind_for_ratio(ratio: int) -> LayerKind:
    """0 -> sliding window only; 4 -> CSA (overlapping blocks + indexer); any other ratio > 1 -> HCA."""
    if ratio == 0:
        return "sliding"
    if ratio == CSA_RATIO:
        return "csa"
    if ratio > 1:
        return "hca"
    raise ValueError(f"DS4 compression ratio must be 0, {CSA_RATIO} or another integer > 1 (128 in DS4); got {ratio}.")  # error-catalogue: internal: the model config layer validated the ratios before


@dataclass(frozen=True)
class DS4AttentionSpec:
    """All sizes of one DS4 attention layer (DS4-Flash values in brackets)."""

    hidden_size: int  # [4096]
    num_heads: int  # [64]
    head_dim: int  # [512]; K = V = one shared head of this size
    rope_dim: int  # [64]; rotated channels, the last ones of each head
    q_lora_rank: int  # [1024]
    o_groups: int  # [8]
    o_lora_rank: int  # [1024]
    compress_ratio: int = 0  # 0, 4 or 128
    window_size: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on compressed layers; None disables it (plain RoPE with compress_rope_theta).
    yarn_factor: float | None = 16.0
    yarn_original_max_position_embeddings: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-6
    # Megatron's dsa_indexer_loss_coeff: weight of the indexer's KL loss (CSA layers; 0 = off, as the recipes).
    indexer_loss_coeff: float = 0.0
    kind: LayerKind = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "kind", layer_kind_for_ratio(self.compress_ratio))
        problems = []
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            problems.append(f"rope_dim ({self.rope_dim}) must be even and in (0, head_dim={self.head_dim}]")
        if (self.num_heads * self.head_dim) % self.o_groups:
            problems.append(f"num_heads * head_dim ({self.num_heads * self.head_dim}) must divide by o_groups ({self.o_groups})")
        if self.window_size < 1:
            problems.append(f"window_size must be >= 1, got {self.window_size}")
        if self.kind == "csa":
            if self.rope_dim > self.index_head_dim:
                problems.append(f"rope_dim ({self.rope_dim}) must not exceed index_head_dim ({self.index_head_dim})")
            if self.index_topk < 1:
                problems.append(f"index_topk must be >= 1, got {self.index_topk}")
        if not self.indexer_loss_coeff >= 0.0:
            problems.append(f"indexer_loss_coeff must be >= 0, got {self.indexer_loss_coeff}")
        if problems:
            raise ValueError("Invalid DS4 attention sizes: " + "; ".join(problems) + ".")  # error-catalogue: internal: the model config layer validated the sizes before

    @property
    def min_local_rows(self) -> int:
        """D_window: rows each CP rank needs from its left neighbour (and so must hold itself)."""
        return ds4_facts.window_rows(self.window_size, self.compress_ratio)


class _RMSNorm(nn.Module):
    """RMSNorm with a learnable scale, computed in the input dtype."""

    def __init__(self, size: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class GatedPoolCompressor(nn.Module):
    """Compress each block of ``ratio`` rows into one vector by a per-channel softmax-gated sum.

    ``a_t = W_kv x_t``, ``s_t = W_gate x_t + ape[t mod m]``; entry ``b`` is
    ``RoPE_{b*m}(RMSNorm(sum_t softmax_t(s_t) * a_t))``. With ``overlap`` (CSA) the projections are
    twice as wide: channels ``[out:]`` of block ``b`` and channels ``[:out]`` of block ``b - 1`` are
    pooled together over ``2m`` slots (block ``b - 1`` absent for ``b = 0``).
    """

    def __init__(self, hidden: int, out_dim: int, ratio: int, overlap: bool, eps: float, dtype=None):
        super().__init__()
        self.out_dim, self.ratio, self.overlap = out_dim, ratio, overlap
        width = 2 * out_dim if overlap else out_dim
        self.linear_wkv = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.linear_wgate = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=dtype))
        self.norm = _RMSNorm(out_dim, eps, dtype=dtype)

    def forward(self, x: torch.Tensor, block_end: torch.Tensor, block_idx: torch.Tensor, cos, sin) -> torch.Tensor:
        """x: [E, h] rows; block_end: [nb] row index (into x) of each block's last row; block_idx: [nb]
        block number inside its sequence; cos/sin: [nb, r/2] at position block_idx * ratio. -> [nb, out]."""
        m, d = self.ratio, self.out_dim
        a, s = self.linear_wkv(x), self.linear_wgate(x)
        cur = block_end.unsqueeze(1) - (m - 1) + torch.arange(m, device=x.device)  # [nb, m]
        if self.overlap:
            has_prev = (block_idx >= 1).view(-1, 1, 1)
            prev = (cur - m).clamp(min=0)
            prev_a = torch.where(has_prev, a[prev][..., :d], 0.0)
            prev_s = (s[prev][..., :d] + self.ape[:, :d]).masked_fill(~has_prev, float("-inf"))
            values = torch.cat((prev_a, a[cur][..., d:]), dim=1)  # [nb, 2m, d]
            gates = torch.cat((prev_s, s[cur][..., d:] + self.ape[:, d:]), dim=1)
        else:
            values, gates = a[cur], s[cur] + self.ape
        pooled = (values * gates.softmax(dim=1)).sum(dim=1)
        return apply_interleaved_rope(self.norm(pooled), cos, sin)


class LightningIndexer(nn.Module):
    """Scores compressed blocks for each query: ``I(i, b) = sum_h w_{i,h} ReLU(q_{i,h} . k_b) / sqrt(d_I)``.

    Owns its own ratio-4 overlapping compressor at ``index_head_dim`` (the keys ``k_b``), a query
    up-projection from the attention's compressed query ``q_r`` and per-head weights from ``x``.
    """

    def __init__(self, spec: DS4AttentionSpec, dtype=None):
        super().__init__()
        self.n_heads, self.head_dim = spec.index_n_heads, spec.index_head_dim
        self.compressor = GatedPoolCompressor(
            spec.hidden_size, spec.index_head_dim, spec.compress_ratio, overlap=True, eps=spec.rms_norm_eps, dtype=dtype
        )
        self.linear_wq_b = nn.Linear(spec.q_lora_rank, spec.index_n_heads * spec.index_head_dim, bias=False, dtype=dtype)
        self.linear_weights_proj = nn.Linear(spec.hidden_size, spec.index_n_heads, bias=False, dtype=dtype)

    def scores(self, x: torch.Tensor, q_r: torch.Tensor, keys: torch.Tensor, cos_q, sin_q) -> torch.Tensor:
        """x: [T, h]; q_r: [T, q_lora]; keys: [NB, d_I]; cos/sin [T, r/2] -> [T, NB]."""
        q = self.linear_wq_b(q_r).view(q_r.shape[0], self.n_heads, self.head_dim)
        q = apply_interleaved_rope(q, cos_q.unsqueeze(1), sin_q.unsqueeze(1))
        weights = self.linear_weights_proj(x) * self.n_heads**-0.5  # [T, nI]
        per_head = torch.einsum("thd,bd->thb", q, keys).relu() * self.head_dim**-0.5
        return (per_head * weights.unsqueeze(-1)).sum(dim=1)


class CoreAttention(nn.Module):
    """The parameters Megatron-LM dev keeps in its ``CompressedSparseAttention`` (the DS4 layer's
    ``core_attention``): the per-head ``attn_sink`` on every layer, the block ``compressor`` for
    compressed layers (m > 1) and the ``indexer`` for CSA. Holding them here gives our state dict dev's
    names (``self_attention.core_attention.*``); the computation stays in :class:`DS4HybridAttention`."""

    def __init__(self, spec: DS4AttentionSpec, dtype=None):
        super().__init__()
        self.attn_sink = nn.Parameter(torch.zeros(spec.num_heads, dtype=dtype))
        self.compressor = None
        self.indexer = None
        if spec.kind != "sliding":
            self.compressor = GatedPoolCompressor(
                spec.hidden_size, spec.head_dim, spec.compress_ratio, overlap=spec.kind == "csa", eps=spec.rms_norm_eps, dtype=dtype
            )
        if spec.kind == "csa":
            self.indexer = LightningIndexer(spec, dtype=dtype)


@dataclass
class _Rows:
    """Where this rank's rows sit in the global packed buffer."""

    seq: torch.Tensor  # [E] sequence index of each row (halo included)
    pos: torch.Tensor  # [E] position inside the sequence; -1 for halo rows before the buffer start
    halo: int  # number of leading halo rows
    local_start: int  # global row of the first local row


class DS4HybridAttention(nn.Module):
    """DeepSeek-V4 hybrid attention on packed rows, optionally split contiguously over a CP group.

    Parameters (Megatron-LM dev's names): ``linear_q_down_proj`` [q_lora, h], ``q_layernorm`` [q_lora],
    ``linear_q_up_proj`` [n*d, q_lora], ``linear_kv_proj`` [d, h], ``kv_layernorm`` [d],
    ``linear_o_group_proj`` [g*o_lora, n*d/g], ``linear_proj`` [h, g*o_lora]; under ``core_attention``:
    ``attn_sink`` [n], for m > 1 ``compressor.{linear_wkv, linear_wgate, ape, norm}``, for CSA
    ``indexer.{linear_wq_b, linear_weights_proj, compressor.*}``.
    """

    #: The CP partition mode this attention consumes (the protocol of verl_ds4.mcore.requirements,
    #: read by the engine's layout resolver): DS4 derives positions from one offset per rank.
    required_cp_partition_mode: ClassVar[str] = ds4_facts.CP_PARTITION_MODE

    def __init__(self, spec: DS4AttentionSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self._build(spec, dtype)

    # -- construction --------------------------------------------------------------------------
    def _build(self, spec: DS4AttentionSpec, dtype) -> None:
        self.spec = spec
        h, n, d = spec.hidden_size, spec.num_heads, spec.head_dim
        self.linear_q_down_proj = nn.Linear(h, spec.q_lora_rank, bias=False, dtype=dtype)
        self.q_layernorm = _RMSNorm(spec.q_lora_rank, spec.rms_norm_eps, dtype=dtype)
        self.linear_q_up_proj = nn.Linear(spec.q_lora_rank, n * d, bias=False, dtype=dtype)
        self.linear_kv_proj = nn.Linear(h, d, bias=False, dtype=dtype)
        self.kv_layernorm = _RMSNorm(d, spec.rms_norm_eps, dtype=dtype)
        self.linear_o_group_proj = nn.Parameter(torch.empty(spec.o_groups * spec.o_lora_rank, n * d // spec.o_groups, dtype=dtype))
        nn.init.normal_(self.linear_o_group_proj, std=0.02)
        self.linear_proj = nn.Linear(spec.o_groups * spec.o_lora_rank, h, bias=False, dtype=dtype)
        self.core_attention = CoreAttention(spec, dtype=dtype)
        self.last_indexer_loss: torch.Tensor | None = None  # global over CP, detached (indexer_loss_report)
        self.sparse_core: str = "dense"  # or "linear" (verl_ds4.kernels.set_sparse_core)
        # query rows per chunk of the compressed blocks' work (verl_ds4.models.query_chunks); None: a 64 MiB budget
        self.query_chunk_rows: int | None = None
        if spec.kind == "sliding":
            inv_freq = default_inv_freq(spec.rope_dim, spec.rope_theta)
        elif spec.yarn_factor is None:
            inv_freq = default_inv_freq(spec.rope_dim, spec.compress_rope_theta)
        else:
            inv_freq = yarn_inv_freq(
                spec.rope_dim,
                spec.compress_rope_theta,
                spec.yarn_factor,
                spec.yarn_original_max_position_embeddings,
                spec.yarn_beta_fast,
                spec.yarn_beta_slow,
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # float64 on purpose

    @property
    def attn_sink(self) -> nn.Parameter:
        return self.core_attention.attn_sink

    @property
    def compressor(self) -> GatedPoolCompressor | None:
        return self.core_attention.compressor

    @property
    def indexer(self) -> LightningIndexer | None:
        return self.core_attention.indexer

    @property
    def indexer_replay_width(self) -> int | None:
        """``index_topk`` of a CSA layer (its choices can be replayed: verl_ds4.mcore.indexer_replay), else None."""
        return self.spec.index_topk if self.indexer is not None else None

    # -- layout contract -----------------------------------------------------------------------
    @property
    def min_local_rows(self) -> int:
        """Smallest number of packed rows every CP rank must hold (D_window; the protocol's row minimum)."""
        return self.spec.min_local_rows

    @classmethod
    def check_cp_partition(cls, cp_partition_mode: str | None, cp_size: int) -> None:
        """Reject any CP split other than the contiguous one before it silently scrambles positions."""
        if cp_size > 1 and cp_partition_mode != cls.required_cp_partition_mode:
            raise ValueError(
                f"DS4 THD CP requires a contiguous CP partition, got cp_partition_mode={cp_partition_mode!r} "
                f"at cp_size={cp_size}. DS4 derives positions from global_start = cp_rank * local_rows, which "
                "only addresses rows of a contiguous split (a zigzag rank holds two chunks of every sequence). "
                "Build the batch with the contiguous layout and set packed_seq_params.cp_partition_mode='contiguous'."
            )

    # -- forward -------------------------------------------------------------------------------
    def _locate_rows(self, cu_seqlens_padded: torch.Tensor, local_rows: int, cp_rank: int, halo: int) -> _Rows:
        cu = cu_seqlens_padded.to(device=self.inv_freq.device, dtype=torch.long)
        start = cp_rank * local_rows
        rows = torch.arange(start - halo, start + local_rows, device=cu.device)
        seq = torch.bucketize(rows.clamp(min=0), cu[1:], right=True)
        pos = torch.where(rows >= 0, rows - cu[seq.clamp(max=cu.numel() - 2)], -1)
        return _Rows(seq=seq, pos=pos, halo=halo, local_start=start)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens_padded: torch.Tensor,
        cp_group: dist.ProcessGroup | None = None,
        cp_partition_mode: str | None = "contiguous",
        real_seqlens: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """x: [T, h] this rank's packed rows; cu_seqlens_padded: global int tensor [B + 1] (identical on
        every rank, ``cu_seqlens_padded[-1] == T * cp_size``). Returns [T, h].

        ``real_seqlens``: ``(lengths [B] in buffer order, their sum)``, the real (unpadded) length of each
        packed sequence; only the indexer loss reads it (its queries and divisor are the real tokens,
        so the loss does not change with the CP padding). ``None``: every row is real."""
        spec = self.spec
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self.check_cp_partition(cp_partition_mode, cp_size)
        if x.dim() != 2 or x.shape[1] != spec.hidden_size:
            raise ValueError(f"DS4 attention expects packed rows [T, {spec.hidden_size}], got {tuple(x.shape)}.")  # error-catalogue: internal: a forward got a tensor of another model
        local_rows = x.shape[0]
        total = int(cu_seqlens_padded[-1])
        if total != local_rows * cp_size:
            raise ValueError(
                f"cu_seqlens_padded[-1] ({total}) must equal local_rows * cp_size ({local_rows} * {cp_size}): pass the "
                "global padded cu_seqlens (identical on every rank), not a per-rank slice."
            )
        halo = 0
        xe = x
        if cp_size > 1:
            halo = spec.min_local_rows
            if local_rows < halo:
                raise RuntimeError(
                    f"DS4 CP boundary exchange requires local rows >= D_window: local_rows={local_rows}, "
                    f"D_window={halo} (window {spec.window_size}, ratio {spec.compress_ratio}). Pad the packed batch "
                    f"to at least cp_size * {halo} = {cp_size * halo} rows (PlanOptions(min_local_rows={halo}))."
                )
            xe = torch.cat((exchange_left_halo(x, halo, cp_group), x), dim=0)
        rows = self._locate_rows(cu_seqlens_padded, local_rows, cp_rank, halo)
        q_pos = rows.pos[halo:]
        dtype = x.dtype
        n, d = spec.num_heads, spec.head_dim
        scale = d**-0.5

        cos_e, sin_e = rope_cos_sin(self.inv_freq, rows.pos.clamp(min=0), dtype)
        cos_q, sin_q = cos_e[halo:], sin_e[halo:]

        q_r = self.q_layernorm(self.linear_q_down_proj(x))
        q = _unweighted_rms(self.linear_q_up_proj(q_r).view(local_rows, n, d), spec.rms_norm_eps)
        q = apply_interleaved_rope(q, cos_q.unsqueeze(1), sin_q.unsqueeze(1))
        kv = apply_interleaved_rope(self.kv_layernorm(self.linear_kv_proj(xe)), cos_e, sin_e)  # [E, d]

        # Sliding window: key k steps back from the query, visible while it stays in the sequence.
        back = torch.arange(spec.window_size, device=x.device)
        key_rows = halo + torch.arange(local_rows, device=x.device).unsqueeze(1) - back  # [T, W]
        win_visible = back.unsqueeze(0) <= q_pos.unsqueeze(1)
        real = None  # the indexer loss's queries: the real rows (padding rows would see real blocks)
        queries = total
        if real_seqlens is not None:
            lengths, queries = real_seqlens
            real = q_pos < lengths.to(device=q_pos.device, dtype=torch.long)[rows.seq[halo:].clamp(max=lengths.numel() - 1)]
        sel = None
        if self.compressor is not None:
            sel = self._compressed(x, xe, q_r, rows, cu_seqlens_padded, cp_rank, cp_size, cp_group, cos_q, sin_q)
            sel.real = real
        out, kl = self._attend(q, kv, key_rows, win_visible, sel, scale)
        out = apply_interleaved_rope(out, cos_q.unsqueeze(1), -sin_q.unsqueeze(1))

        # Grouped low-rank output projection.
        g = spec.o_groups
        grouped = out.reshape(local_rows, g, -1)
        weight = self.linear_o_group_proj.view(g, spec.o_lora_rank, -1)
        mixed = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(local_rows, g * spec.o_lora_rank)
        result = self.linear_proj(mixed)
        self.last_indexer_loss = None
        if kl is not None:
            # DS4's indexer loss (indexer_loss.py): KL(detached main attention over the compressed
            # blocks, normalised with the window + sink mass || softmax of the indexer scores), this
            # rank's rows over the whole group's row count; its gradient joins the output's backward.
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

            loss = spec.indexer_loss_coeff * kl / max(int(queries), 1)
            report = loss.detach().clone()
            if cp_size > 1:
                dist.all_reduce(report, group=cp_group)
            self.last_indexer_loss = report
            result = DSAIndexerLossAutoScaler.apply(result, loss)
        return result

    def _attend(self, q, kv, key_rows, win_visible, sel, scale) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([T, n, d], the indexer KL sum or None)``: the attention over each query's window keys and the compressed
        blocks ``sel`` lets it see (:mod:`.csa_rows`: row chunks), with the dense or the linear core."""
        return attend_rows(self, q, kv, key_rows, win_visible, sel, scale)

    def _replayed_choice(self, chosen, visible, n_blocks, first_block, q_seq, start: int = 0, total: int | None = None) -> torch.Tensor:
        """The indexer replay's choice ``[c, NB]`` over the buffer's blocks for local rows ``start..start + c``:
        ``chosen`` / ``visible`` seen as each query's own-sequence blocks ``[c, E]`` (what
        :class:`~verl_ds4.mcore.indexer_replay.IndexerReplay` records and replays), and back."""
        first = first_block
        entries = torch.arange(int(n_blocks.max()), device=visible.device)
        in_seq = entries < n_blocks[q_seq].unsqueeze(1)
        own = (first[q_seq].unsqueeze(1) + entries).clamp(max=visible.shape[1] - 1)
        own_choice = self.indexer_replay.select(chosen.gather(1, own) & in_seq, visible.gather(1, own) & in_seq, start=start, total=total)
        out = torch.zeros(visible.shape[0], visible.shape[1] + 1, dtype=torch.bool, device=visible.device)
        return out.scatter_(1, torch.where(own_choice & in_seq, own, visible.shape[1]), True)[:, :-1]

    def _indexer_loss_active(self) -> bool:
        """The indexer loss runs in training forwards with autograd on and a positive coefficient only
        (as Megatron-LM dev); otherwise the indexer path is the no-grad top-k it always was."""
        return self.indexer is not None and self.spec.indexer_loss_coeff > 0 and self.training and torch.is_grad_enabled()

    def _compressed(self, x, xe, q_r, rows: _Rows, cu_seqlens_padded, cp_rank, cp_size, cp_group, cos_q, sin_q):
        """The compressed KV of every completed block in the buffer ([NB, d], gathered over CP) and, for CSA, the
        indexer's keys and its choice per local query (compact ids, chosen in row chunks): a
        :class:`~.csa_rows.Selection`, whose ``[rows, NB]`` masks are made chunk by chunk."""
        spec = self.spec
        m = spec.compress_ratio
        device = x.device
        cu = cu_seqlens_padded.to(device=device, dtype=torch.long)
        n_blocks = (cu[1:] - cu[:-1]) // m  # per sequence
        block_seq = torch.repeat_interleave(torch.arange(n_blocks.numel(), device=device), n_blocks)
        first_block = torch.cumsum(n_blocks, 0) - n_blocks
        block_idx = torch.arange(block_seq.numel(), device=device) - first_block[block_seq]
        block_end = cu[block_seq] + block_idx * m + (m - 1)  # global row of each block's last row
        owner = block_end // x.shape[0]
        mine = owner == cp_rank
        counts = torch.bincount(owner, minlength=cp_size).tolist() if block_seq.numel() else [0] * cp_size

        end_local = block_end[mine] - (rows.local_start - rows.halo)
        cos_b, sin_b = rope_cos_sin(self.inv_freq, block_idx[mine] * m, x.dtype)
        comp = self.compressor(xe, end_local, block_idx[mine], cos_b, sin_b)
        if cp_size > 1:
            comp = all_gather_rows(comp, counts, cp_group)
        sel = Selection(comp=comp, block_seq=block_seq, block_idx=block_idx, ratio=m, q_seq=rows.seq[rows.halo :], q_pos=rows.pos[rows.halo :])
        if self.indexer is not None and block_seq.numel():
            # The indexer sees detached inputs and top-k has no gradient. Only the indexer loss needs
            # autograd here (the indexer's own parameters); the scores are the same values either way.
            with torch.set_grad_enabled(self._indexer_loss_active()):
                keys = self.indexer.compressor(xe.detach(), end_local, block_idx[mine], cos_b, sin_b)
                if cp_size > 1:
                    keys = all_gather_rows(keys, counts, cp_group)
            sel.index_inputs = (x.detach(), q_r.detach(), keys, cos_q, sin_q)
            sel.with_loss = self._indexer_loss_active()
            choose(self, sel, n_blocks, first_block)
        return sel
