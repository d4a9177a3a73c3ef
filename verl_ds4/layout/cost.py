"""Per-token compute cost models for context-parallel balancing.

A cost model answers one question: how much compute does the token at position ``p``
(0-based, inside its own packed sequence) cost in one forward pass, summed over all layers?
Two models live here:

* :func:`ds4_cost_model` - DeepSeek-V4 (hybrid CSA / HCA / window attention). Per layer and token:
  a position-independent part (projections, compressors, MoE experts) plus attention over
  ``min(p+1, W)`` window keys, and, by layer ratio ``m``:
  ``m = 4`` (CSA): ``min(floor((p+1)/4), k)`` selected compressed keys plus the indexer scoring
  ``floor((p+1)/4)`` candidates; ``m = 128`` (HCA): ``floor((p+1)/128)`` compressed keys;
  ``m = 0``: the window only. Only the indexer and HCA terms grow without bound.
  (``docs/ds4-context-parallel.md`` section 2.)
* :func:`dense_causal_cost_model` - dense causal attention: ``p + 1`` keys per token, optionally
  plus a position-independent part.

Every model is a sum of a few *terms* whose prefix sums have closed forms, so the cost of the
first ``n`` tokens of a sequence (:meth:`TokenCostModel.prefix_cost`) is exact and O(1) per
sequence: that is what makes balancing 1024 sequences in well under a millisecond possible.

Units: DS4 costs are in "position-independent token compute" (the cost of one token's
projections + MoE summed over layers is exactly 1.0); dense costs are in attention keys.
Padding rows cost :attr:`TokenCostModel.pad_row_cost` each (their linear layers still run;
attention skips them).

All DS4 coefficients are derived in one place, :class:`DS4CostShape`, from the model shape
(defaults: DS4-Flash as published in ``transformers``' ``DeepseekV4Config`` and ``docs/ds4-context-parallel.md``).
With those defaults one sequence filling a contiguous CP buffer gives the per-rank max/mean the
``docs/ds4-context-parallel.md`` estimates (1.03 at 16K/CP4, 1.11 at 64K/CP16, 1.19 at 128K/CP16); a test pins this.

Dynamic CP (verl ``dynamic_context_parallel``): why there is no drop-in cost hook
---------------------------------------------------------------------------------
:func:`dcp_workload` is the DS4-aware replacement for the workload Megatron's dynamic-CP
scheduler uses, but it cannot be plugged in without copying code, as of verl 0.9.1 and
Megatron-LM ``dev``:

* verl builds ``verl.utils.dynamic_cp_scheduler.DynamicCPScheduler`` inline in
  ``MegatronEngine.forward_backward_batch`` (``workers/engine/megatron/transformer_impl.py``),
  with no config field or engine hook for the workload; ``DynamicCPScheduler.schedule`` takes
  Megatron's ``DefaultDynamicCPScheduler`` (``get_megatron_dynamic_cp_scheduler_cls``) and calls
  its ``get_groups_and_subsamples``.
* In Megatron-LM ``dev`` that method calls ``next_hdp_group_packing_aware``
  (``megatron/core/datasets/data_schedule_utils.py``), whose workload ``seq_len**2 / cp_size`` is
  a local closure, and whose per-rank cap (``tallest * max_seqlen_per_dp_cp_rank``) is in the same
  quadratic units. No parameter, attribute or registry reaches either. (Older ``dev`` revisions
  passed a ``workload_fn`` to ``next_hdp_group``; that API is gone.)
* Replacing it would mean copying the ~250-line group-forming algorithm (forbidden here) or
  patching Megatron's module globals at run time for every model (a silent behaviour change).
  megatron-core 0.16.1, the CPU pin, does not ship the scheduler at all.

What does apply under dynamic CP: each scheduled micro-batch is planned with its
``local_cp_size``, so ``PlanOptions(balance=...)`` balances the sequence order inside it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from verl_ds4 import ds4_facts

__all__ = [
    "DS4CostShape",
    "DS4_FLASH_LAYER_RATIOS",
    "DS4_PRO_LAYER_RATIOS",
    "TokenCostModel",
    "CostTerm",
    "ds4_cost_model",
    "dense_causal_cost_model",
    "get_cost_model",
    "dcp_workload",
    "COST_MODELS",
]

# Compression ratio per layer, MTP layer included (0 = window only, 4 = CSA, 128 = HCA).
DS4_FLASH_LAYER_RATIOS: tuple[int, ...] = ds4_facts.with_mtp(ds4_facts.FLASH_LAYER_RATIOS, 1)
DS4_PRO_LAYER_RATIOS: tuple[int, ...] = ds4_facts.with_mtp(ds4_facts.PRO_LAYER_RATIOS, 1)


@dataclass(frozen=True)
class CostTerm:
    """One term ``coef * g(p)`` of a per-token cost, with ``q = p + 1`` (keys visible to token ``p``).

    ``kind``:
      * ``"const"``:  ``g = 1``
      * ``"linear"``: ``g = q``                          (dense causal keys)
      * ``"min"``:    ``g = min(q, a)``                  (sliding window of ``a`` keys)
      * ``"floor"``:  ``g = floor(q / a)``               (completed compressed blocks of ratio ``a``)
      * ``"floor_cap"``: ``g = min(floor(q / a), b)``    (top-``b`` of the compressed blocks)
    """

    kind: str
    coef: float
    a: int = 0
    b: int = 0

    def __post_init__(self):
        if self.kind not in ("const", "linear", "min", "floor", "floor_cap"):
            raise ValueError(f"unknown cost term kind {self.kind!r}")
        if self.kind in ("min", "floor", "floor_cap") and self.a <= 0:
            raise ValueError(f"cost term {self.kind!r} needs a positive a, got {self.a}")
        if self.kind == "floor_cap" and self.b <= 0:
            raise ValueError(f"cost term 'floor_cap' needs a positive b, got {self.b}")

    def per_token(self, q: torch.Tensor) -> torch.Tensor:
        """``g(q)`` for float64 ``q = p + 1 >= 1``."""
        if self.kind == "const":
            return torch.ones_like(q)
        if self.kind == "linear":
            return q
        if self.kind == "min":
            return q.clamp(max=self.a)
        if self.kind == "floor":
            return torch.floor(q / self.a)
        return torch.floor(q / self.a).clamp(max=self.b)

    def prefix(self, n):
        """``sum_{q=1..n} g(q)`` for float64 integral ``n >= 0`` (closed form; a torch tensor or a NumPy array)."""
        if self.kind == "const":
            return n
        if self.kind == "linear":
            return n * (n + 1) / 2
        if self.kind == "min":
            a = float(self.a)
            m = n.clip(max=a)
            return m * (m + 1) / 2 + a * (n - m)
        if self.kind == "floor":
            return _floor_prefix(n, float(self.a))
        # floor(q/a) < b exactly for q < a*b; from q = a*b on the term is capped at b.
        a, b = float(self.a), float(self.b)
        m = n.clip(max=a * b - 1)
        return _floor_prefix(m, a) + b * (n - m)


def _floor_prefix(n, a: float):
    # sum_{q=1..n} floor(q/a) with t = floor(n/a): a*t*(t-1)/2 + t*(n - a*t + 1)
    t = np.floor(n / a) if isinstance(n, np.ndarray) else torch.floor(n / a)
    return a * t * (t - 1) / 2 + t * (n - a * t + 1)


@dataclass(frozen=True)
class TokenCostModel:
    """Per-token cost ``c(p) = sum(term.coef * term.g(p + 1))``; padding rows cost ``pad_row_cost``."""

    name: str
    terms: tuple[CostTerm, ...]
    pad_row_cost: float
    unit: str = "cost"
    description: str = ""

    def token_cost(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 cost of tokens at 0-based ``positions`` inside their sequence."""
        q = torch.as_tensor(positions).to(torch.float64) + 1
        out = torch.zeros_like(q)
        for term in self.terms:
            out = out + term.coef * term.per_token(q)
        return out

    def prefix_cost(self, n):
        """float64 cost of the first ``n`` real tokens of a sequence (``n >= 0``, elementwise).

        A NumPy array in gives a NumPy array out (the balancer's host arithmetic); anything else
        is taken as a tensor."""
        if isinstance(n, np.ndarray):
            nn = n.astype(np.float64)
            out = np.zeros_like(nn)
            for term in self.terms:
                out += term.coef * term.prefix(nn)
            return out
        nn = torch.as_tensor(n).to(torch.float64)
        out = torch.zeros_like(nn)
        for term in self.terms:
            out = out + term.coef * term.prefix(nn)
        return out

    def sequence_cost(self, seqlens: torch.Tensor, padded_lens: torch.Tensor | None = None) -> torch.Tensor:
        """float64 cost of whole sequences: real tokens plus ``padded - real`` padding rows."""
        cost = self.prefix_cost(seqlens)
        if padded_lens is not None:
            cost = cost + self.pad_row_cost * (torch.as_tensor(padded_lens) - torch.as_tensor(seqlens)).to(
                torch.float64
            )
        return cost


@dataclass(frozen=True)
class DS4CostShape:
    """The DS4 shape numbers the cost model is derived from (defaults: DS4-Flash).

    Sources: ``docs/ds4-context-parallel.md`` section 2 (window 128, top-k 512 Flash / 1024 Pro, head dim 512, rope 64,
    layer ratios) and ``transformers``' ``DeepseekV4Config`` defaults (hidden 4096, 64 heads,
    q LoRA 1024, 8 output groups of LoRA rank 1024, 6 routed + 1 shared experts of width 2048,
    indexer 64 heads x 128). Multiply-accumulates per token, forward pass.
    """

    hidden_size: int = 4096
    num_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_active_experts: int = 7  # 6 routed + 1 shared
    moe_intermediate_size: int = 2048
    window: int = 128
    index_topk: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    layer_ratios: tuple[int, ...] = field(default=DS4_FLASH_LAYER_RATIOS)

    def coefficients(self) -> dict[str, float]:
        """Raw per-token MACs summed over layers, by term (the single source of every DS4 number)."""
        h, nh, d = self.hidden_size, self.num_heads, self.head_dim
        ratios = self.layer_ratios
        ds4_facts.check_compress_ratios(ratios)
        n_layers, n_csa, n_hca = len(ratios), ratios.count(4), ratios.count(128)
        linear_per_layer = (
            h * self.q_lora_rank  # W_DQ
            + self.q_lora_rank * nh * d  # W_UQ
            + h * d  # shared K=V head
            + nh * d * self.o_lora_rank  # grouped low-rank output, first stage
            + self.o_groups * self.o_lora_rank * h  # second stage
            + self.moe_active_experts * 3 * h * self.moe_intermediate_size  # SwiGLU experts
        )
        compressor = 2 * h * d  # a_t and s_t projections
        indexer_proj = self.q_lora_rank * self.index_n_heads * self.index_head_dim
        per_key = 2 * nh * d  # q.k and p.v for one shared K=V key, all heads
        return {
            "const": float(n_layers * linear_per_layer + (n_csa + n_hca) * compressor + n_csa * indexer_proj),
            "window": float(n_layers * per_key),
            "csa_selected": float(n_csa * per_key),
            "indexer": float(n_csa * self.index_n_heads * self.index_head_dim),
            "hca": float(n_hca * per_key),
        }


def ds4_cost_model(shape: DS4CostShape | None = None) -> TokenCostModel:
    """DS4 per-token cost, normalised so the position-independent part is 1.0 per token."""
    shape = shape or DS4CostShape()
    c = shape.coefficients()
    unit = c["const"]
    terms = (
        CostTerm("const", 1.0),
        CostTerm("min", c["window"] / unit, a=shape.window),
        CostTerm("floor_cap", c["csa_selected"] / unit, a=4, b=shape.index_topk),
        CostTerm("floor", c["indexer"] / unit, a=4),
        CostTerm("floor", c["hca"] / unit, a=128),
    )
    return TokenCostModel(
        name="ds4",
        terms=tuple(t for t in terms if t.coef != 0.0),
        pad_row_cost=1.0,
        unit="token-linear",
        description="DeepSeek-V4: linear/MoE + window + CSA top-k + indexer (p/4) + HCA (p/128)",
    )


def dense_causal_cost_model(linear_per_token: float = 0.0) -> TokenCostModel:
    """Dense causal attention: token ``p`` attends ``p + 1`` keys (cost unit: one key).

    ``linear_per_token`` adds a position-independent part in the same unit (0 by default, i.e.
    attention only, which is where the documented 1.5-1.9 contiguous imbalance comes from).
    """
    if linear_per_token < 0:
        raise ValueError(f"linear_per_token must be >= 0, got {linear_per_token}")
    terms = [CostTerm("linear", 1.0)]
    if linear_per_token:
        terms.insert(0, CostTerm("const", float(linear_per_token)))
    return TokenCostModel(
        name="dense",
        terms=tuple(terms),
        pad_row_cost=float(linear_per_token),
        unit="attention-keys",
        description="dense causal attention: p + 1 keys per token",
    )


COST_MODELS = {"ds4": ds4_cost_model, "dense": dense_causal_cost_model}


def get_cost_model(model: str | TokenCostModel) -> TokenCostModel:
    """Resolve a cost model by name (``"ds4"`` or ``"dense"``) or pass one through."""
    if isinstance(model, TokenCostModel):
        return model
    if model not in COST_MODELS:
        raise ValueError(f"unknown cost model {model!r}; expected one of {sorted(COST_MODELS)} or a TokenCostModel")
    return _default_model(model)


@functools.lru_cache(maxsize=None)
def _default_model(name: str) -> TokenCostModel:
    return COST_MODELS[name]()  # frozen: one instance per name is shared


def dcp_workload(seq_len: int, cp_size: int, cost_model: str | TokenCostModel = "ds4") -> float:
    """Per-rank compute of one sequence split contiguously over ``cp_size`` ranks (its last, most
    loaded slice), in the cost model's unit: the DS4-aware counterpart of Megatron's dynamic-CP
    workload ``seq_len**2 / cp_size``, with the same argument order.

    Not wired into Megatron's scheduler (see the module docstring for why).
    """
    if seq_len < 0 or cp_size < 1:
        raise ValueError(f"need seq_len >= 0 and cp_size >= 1, got seq_len={seq_len}, cp_size={cp_size}")
    model = get_cost_model(cost_model)
    chunk = -(-seq_len // cp_size)
    ends = torch.tensor([seq_len, max(seq_len - chunk, 0)])
    f = model.prefix_cost(ends)
    return float(f[0] - f[1])
