"""DeepSeek-V4.1's parameter counts in closed form, from its ``config.json`` numbers (pure Python).

    sizes = DS41Sizes.from_hf_config(json.load(open("config.json")))
    sizes.total()                 # backbone + Engram tables (DSpark drafter not counted)
    sizes.layer_params(14)        # {"attention": ..., "engram": ..., "engram_table": ..., ...}
    sizes.dspark_total()          # the mtp.* drafter's own parameters

Shares V4's formulas where V4.1 has the same part (:class:`verl_ds4.models.ds4.sizes.DS4Sizes`: the
MLA-style attention with grouped output, the two mHC sites, one SwiGLU expert, the embedding).
What differs, per layer ``i`` of role ``Full`` / ``Reindex`` / ``Reuse`` / window
(:mod:`verl_ds4.ds41_facts`), with ``h`` hidden, ``d`` head dim, ``r_q`` q_lora_rank, ``n_I`` x
``d_I`` indexer heads, ``n`` mHC streams, ``V`` vocabulary:

==============  ====================================================================================
compressor      Full layers only (Reindex / Reuse read the Full layer's entries): ``d*h`` (``wkv``)
                ``+ d*h`` (``wgate``, ratio > 1 only) ``+ d`` (norm); no position embedding
indexer         index sources (Full and Reindex): ``n_I*d_I*r_q + n_I*h``; Full also owns the key
                projection and its norm ``d_I*d + d_I``
engram          Engram layers: the fused key / value projection ``(n+1)h x (N-1)*heads*hd`` and the
                per-stream query / key norms ``2*n*h``
engram_table    Engram layers: ``rows * hd`` (``engram_num_embeddings[j]`` rows of width
                ``engram_head_dim``): the hashed n-gram tables, 196.6B of Flash's 748.5B
head            output layer ``V*h`` + final norm ``h`` (single-pass mHC: no HC head)
dspark          ``mtp.*``: per stage a window-only layer with ``dspark_n_routed_experts`` experts;
                stage 0 adds ``main_proj`` (targets x h -> h) + ``main_norm``; the last stage adds
                its norm, the Markov head ``2*V*rank`` and the confidence head ``h + rank``. The
                drafter reads the target's (frozen) embedding and output layer: not counted here.
==============  ====================================================================================

``tests/test_ds41_full_size_on_cpu.py`` builds NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM``
and its DSpark drafter at Flash size on the ``meta`` device and checks every component of every
layer against these formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_ds4 import ds41_facts
from verl_ds4.models.ds4.sizes import DS4Sizes, MissingSizeField

__all__ = ["DS41Sizes", "LAYER_COMPONENTS", "EXPERT_SHARDED"]

#: Components of one V4.1 decoder layer, in the order tables print them.
LAYER_COMPONENTS = ("attention", "compressor", "indexer", "mhc", "engram", "engram_table", "moe_router", "moe_routed",
                    "moe_shared")  # fmt: skip
#: Components split like routed experts: over EP, their optimizer state sharded over expert-DP. The
#: Engram tables are row-split over the expert-parallel group (mcore-bridge 1.6.5 loads "EP-local
#: table rows"; docs/memory.md states the assumption).
EXPERT_SHARDED = ("moe_routed", "engram_table")

_NUMBERS = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "index_n_heads",
            "index_head_dim", "hc_mult")  # fmt: skip
_ENGRAM = ("engram_n_heads", "engram_head_dim", "engram_max_ngram_size")
_DSPARK = ("dspark_markov_rank", "dspark_n_routed_experts")


def _required(text, key: str, source: str):
    if text.get(key) is None:
        raise MissingSizeField(f"{source} has no {key!r}, which the V4.1 memory model needs; add it "
                               "(configs/ds4_model/v41_flash.yaml shows every field).")
    return text[key]


@dataclass(frozen=True)
class DS41Sizes(DS4Sizes):
    """V4.1's size numbers; ``compress_ratios`` are the backbone's (DSpark stages excluded)."""

    roles: tuple[str, ...] = ()
    engram_layers: tuple[int, ...] = ()
    engram_table_rows: tuple[int, ...] = ()
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_max_ngram_size: int = 0
    dspark_stages: int = 0
    dspark_targets: int = 0
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0

    expert_sharded = EXPERT_SHARDED

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config", fallback: Mapping[str, Any] | None = None) -> "DS41Sizes":
        """From a V4.1 ``config.json`` dict (nested or flat text config) or a ``ds4.model`` recipe block.

        The layer roles come from :func:`verl_ds4.ds41_facts.read_config` (``ValueError`` for a broken
        schedule); a missing number raises :class:`MissingSizeField` naming it and ``source``.
        """
        text = dict(ds41_facts.text_config(config))
        for key, value in (fallback or {}).items():
            text.setdefault(key, value)
        text.setdefault("num_hidden_layers", text.get("num_layers"))
        facts = ds41_facts.read_config({**text, "model_type": ds41_facts.HF_TEXT_MODEL_TYPE})
        values: dict[str, Any] = {}
        needed = _NUMBERS + (_ENGRAM if facts.engram_layers else ()) + (_DSPARK if facts.dspark_stages else ())
        for key in needed:
            if text.get(key) is None:
                raise MissingSizeField(f"{source} has no {key!r}, which the V4.1 memory model needs; add it "
                                       "(configs/ds4_model/v41_flash.yaml shows every field).")
            values[key] = int(text[key])
        layers = list(text.get("engram_layer_ids") or [])
        rows = [int(r) for r, layer in zip(text.get("engram_num_embeddings") or [], layers) if layer < facts.num_layers]
        return cls(
            **values,
            compress_ratios=facts.compress_ratios,
            mtp_layers=0,
            index_topk=int(_required(text, "index_topk", source)),
            roles=tuple(r.role for r in facts.roles),
            engram_layers=facts.engram_layers,
            engram_table_rows=tuple(rows),
            dspark_stages=facts.dspark_stages,
            dspark_targets=len(facts.dspark_targets),
        )

    # ---- one decoder layer -------------------------------------------------------------------
    def v41_compressor(self, layer: int) -> int:
        if self.roles[layer] != ds41_facts.FULL:
            return 0
        d, h = self.head_dim, self.hidden_size
        return d * h * (2 if self.compress_ratios[layer] > 1 else 1) + d

    def v41_indexer(self, layer: int) -> int:
        role = self.roles[layer]
        if role not in (ds41_facts.FULL, ds41_facts.REINDEX):
            return 0
        ni, di = self.index_n_heads, self.index_head_dim
        own_keys = di * self.head_dim + di if role == ds41_facts.FULL else 0
        return ni * di * self.q_lora_rank + ni * self.hidden_size + own_keys

    def engram(self, layer: int) -> tuple[int, int]:
        """(projections and norms, table) of ``layer``'s Engram; ``(0, 0)`` without Engram."""
        if layer not in self.engram_layers:
            return 0, 0
        n, h, hd = self.hc_mult, self.hidden_size, self.engram_head_dim
        width = (self.engram_max_ngram_size - 1) * self.engram_n_heads * hd
        rows = self.engram_table_rows[self.engram_layers.index(layer)]
        return (n + 1) * h * width + 2 * n * h, rows * hd

    def layer_params(self, layer: int) -> dict[str, int]:
        """Parameters of backbone layer ``layer`` (0-based), per component."""
        h = self.hidden_size
        engram, table = self.engram(layer)
        return {
            "attention": self.attention(),
            "compressor": self.v41_compressor(layer),
            "indexer": self.v41_indexer(layer),
            "mhc": self.mhc(),
            "engram": engram,
            "engram_table": table,
            "moe_router": self.n_routed_experts * h + h,
            "moe_routed": self.n_routed_experts * self.expert(),
            "moe_shared": self.n_shared_experts * self.expert(),
        }

    def layer(self, ratio: int) -> dict[str, int]:
        raise TypeError("V4.1 layers differ by role, not by ratio: use layer_params(layer_index).")

    # ---- outside the layers ------------------------------------------------------------------
    def hc_head(self) -> int:
        return 0  # single-pass mHC: the last sublayer collapses the streams

    def head(self) -> int:
        return self.vocab_size * self.hidden_size + self.hidden_size

    def dspark_stage(self, stage: int) -> dict[str, int]:
        """One DSpark stage (``mtp.<stage>``), per component; the shared embedding / head excluded."""
        h, r = self.hidden_size, self.dspark_markov_rank
        parts = {
            "attention": self.attention(),
            "mhc": self.mhc(),
            "moe_router": self.dspark_n_routed_experts * h + h,
            "moe_routed": self.dspark_n_routed_experts * self.expert(),
            "moe_shared": self.n_shared_experts * self.expert(),
            "dspark_extra": 0,
        }
        if stage == 0:
            parts["dspark_extra"] += self.dspark_targets * h * h + h  # main_proj, main_norm
        if stage == self.dspark_stages - 1:
            parts["dspark_extra"] += h + 2 * self.vocab_size * r + h + r  # norm, Markov head, confidence head
        return parts

    def dspark_total(self) -> int:
        return sum(sum(self.dspark_stage(s).values()) for s in range(self.dspark_stages))

    def mtp_layer(self) -> dict[str, int]:
        raise TypeError("V4.1 has no MTP layer; its mtp.* stages are a DSpark drafter (dspark_stage).")

    # ---- totals ------------------------------------------------------------------------------
    def decoder_total(self) -> int:
        return sum(sum(self.layer_params(i).values()) for i in range(self.num_layers))

    def engram_tables(self) -> int:
        return sum(self.engram(i)[1] for i in self.engram_layers)

    def total(self, mtp: bool = False) -> int:
        """Backbone + Engram tables (``mtp=True`` adds the DSpark drafter's own parameters)."""
        return self.embedding() + self.decoder_total() + self.head() + (self.dspark_total() if mtp else 0)

    def activated(self) -> int:
        """Parameters one token activates: no input embedding, top-k routed experts, one row of each
        Engram table lookup (``(N-1) x heads`` rows of ``hd``), the head."""
        routed = sum(self.layer_params(i)["moe_routed"] for i in range(self.num_layers))
        active_routed = self.num_layers * self.num_experts_per_tok * self.expert()
        lookups = len(self.engram_layers) * (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim
        return self.total() - self.embedding() - routed + active_routed - self.engram_tables() + lookups
