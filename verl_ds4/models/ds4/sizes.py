"""DS4's parameter counts in closed form, from the numbers of its Hugging Face config (pure Python).

    sizes = DS4Sizes.from_hf_config(json.load(open("config.json")))
    sizes.total()            # 284_332_230_231 for DeepSeek-V4-Flash (MTP not counted)
    sizes.activated()        # 13.27e9: DeepSeek's convention (no input embedding, the head counted)
    sizes.layer(i)           # {"attention": ..., "compressor": ..., "indexer": ..., "mhc": ..., ...}

Every count is the number of elements of the trainable parameters that transformers'
``DeepseekV4ForCausalLM`` and this project's ``DS4Model`` build for the same config (buffers such
as the hash table ``tid2eid`` and the router's selection bias are not parameters);
``tests/test_ds4_full_size_on_cpu.py`` builds both at full size on the ``meta`` device and checks
every component of every layer against these formulas. Components and their formulas, with
``h`` hidden, ``n_h`` heads, ``d`` head dim, ``r_q`` q_lora_rank, ``g`` x ``r_o`` output groups x
rank, ``E`` routed experts of width ``I``, ``n`` mHC streams, ``V`` vocabulary:

==============  ====================================================================================
attention       ``r_q*h + r_q + n_h*d*r_q + d*h + d + (g*r_o)*(n_h*d/g) + h*g*r_o + n_h`` and the
                layer's input norm ``h``
compressor      ratio ``m > 0`` only: ``c = 2d`` for CSA (m = 4, overlapping pools) else ``d``:
                ``2*c*h + m*c + d``
indexer         CSA only (``c_I = 2*d_I``): ``n_I*d_I*r_q + 2*c_I*h + 4*c_I + d_I + n_I*h``
mhc             two sites, each ``(2+n)*n * n*h + (2+n)*n + 3``
moe_router      ``E*h`` (and the post-attention norm ``h``)
moe_routed      ``E * 3*I*h`` (fused gate/up ``2I x h`` and down ``h x I`` per expert)
moe_shared      ``n_shared * 3*I*h``
embedding       ``V*h``; head ``V*h`` + final norm ``h`` + HC head ``n*n*h + n + 1``
mtp (each)      one window-only layer + ``enorm``/``hnorm`` (``2h``) + ``e_proj``/``h_proj``
                (``2h^2``) + its own HC head and final norm
==============  ====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_ds4 import ds4_facts

__all__ = ["DS4Sizes", "LAYER_COMPONENTS", "ROUTED", "MissingSizeField"]

#: Components of one decoder layer, in the order tables print them.
LAYER_COMPONENTS = ("attention", "compressor", "indexer", "mhc", "moe_router", "moe_routed", "moe_shared")
#: The component whose parameters are the routed experts (split over EP, sharded over expert-DP).
ROUTED = "moe_routed"

# HF config key -> (field, type); every one is required (a missing key raises MissingSizeField).
_FIELDS = {
    "vocab_size": int,
    "hidden_size": int,
    "num_attention_heads": int,
    "head_dim": int,
    "q_lora_rank": int,
    "o_groups": int,
    "o_lora_rank": int,
    "n_routed_experts": int,
    "n_shared_experts": int,
    "num_experts_per_tok": int,
    "moe_intermediate_size": int,
    "index_n_heads": int,
    "index_head_dim": int,
    "hc_mult": int,
}


class MissingSizeField(KeyError):
    """A config (or recipe model block) lacks a number the parameter count needs."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0])


@dataclass(frozen=True)
class DS4Sizes:
    """The architecture numbers that decide DS4's parameter counts (names as in ``config.json``)."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    compress_ratios: tuple[int, ...]
    mtp_layers: int = 0
    #: Indexer top-k of the CSA layers (no parameters; the memory model's attention keys read it).
    index_topk: int = 512

    #: Components split over EP whose optimizer state shards over expert-DP (the memory model reads it).
    expert_sharded = (ROUTED,)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config", fallback: Mapping[str, Any] | None = None) -> "DS4Sizes":
        """From a ``config.json`` dict (or a ``ds4.model`` recipe block: same key names).

        A key missing in ``config`` is read from ``fallback``; missing in both raises
        :class:`MissingSizeField` naming it and ``source``.
        """
        text = config.get("text_config") or config
        fallback = fallback or {}
        values: dict[str, Any] = {}
        for key, kind in _FIELDS.items():
            value = text.get(key, fallback.get(key))
            if value is None:
                raise MissingSizeField(
                    f"{source} has no {key!r}, which the memory model needs; add it (DeepSeek-V4's config.json "
                    f"has it, and configs/ds4_model/flash.yaml shows every field)."
                )
            values[key] = kind(value)
        if "num_hidden_layers" in text:
            ratios = ds4_facts.layer_compress_ratios(text)
        elif fallback.get("compress_ratios") is not None:
            ratios = tuple(int(r) for r in fallback["compress_ratios"])
        else:
            raise MissingSizeField(f"{source} has neither num_hidden_layers nor compress_ratios.")
        mtp = text.get("num_nextn_predict_layers", fallback.get("mtp_layers", fallback.get("num_nextn_predict_layers", 0)))
        topk = text.get("index_topk", fallback.get("index_topk"))
        if topk is None:  # the peak model reads it (the sparse attention's gathered rows): no silent default
            raise MissingSizeField(f"{source} has no 'index_topk', which the memory model needs; add it (DeepSeek-V4's "
                                   "config.json has it: 512 for Flash, 1024 for Pro).")
        return cls(**values, compress_ratios=tuple(ratios), mtp_layers=int(mtp or 0), index_topk=int(topk))

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    # ---- one decoder layer -------------------------------------------------------------------
    def attention(self) -> int:
        h, nh, d, rq, g, ro = (self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank,
                               self.o_groups, self.o_lora_rank)
        q = rq * h + rq + nh * d * rq
        kv = d * h + d
        out = (g * ro) * (nh * d // g) + h * g * ro
        return q + kv + out + nh + h  # + sinks + the layer's input norm

    def compressor(self, ratio: int) -> int:
        if ratio == ds4_facts.WINDOW_ONLY:
            return 0
        d, h = self.head_dim, self.hidden_size
        width = 2 * d if ratio == ds4_facts.CSA_RATIO else d
        return 2 * width * h + ratio * width + d

    def indexer(self, ratio: int) -> int:
        if ratio != ds4_facts.CSA_RATIO:
            return 0
        h, ni, di = self.hidden_size, self.index_n_heads, self.index_head_dim
        width = 2 * di
        return ni * di * self.q_lora_rank + 2 * width * h + ds4_facts.CSA_RATIO * width + di + ni * h

    def mhc(self) -> int:
        n, h = self.hc_mult, self.hidden_size
        mix = (2 + n) * n
        return 2 * (mix * n * h + mix + 3)

    def expert(self) -> int:
        """One routed expert (SwiGLU: gate and up ``I x h``, down ``h x I``)."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def layer(self, ratio: int) -> dict[str, int]:
        """Parameters of one decoder layer of compression ratio ``ratio``, per component."""
        h = self.hidden_size
        return {
            "attention": self.attention(),
            "compressor": self.compressor(ratio),
            "indexer": self.indexer(ratio),
            "mhc": self.mhc(),
            "moe_router": self.n_routed_experts * h + h,  # + the post-attention norm
            "moe_routed": self.n_routed_experts * self.expert(),
            "moe_shared": self.n_shared_experts * self.expert(),
        }

    def layer_params(self, layer: int) -> dict[str, int]:
        """Parameters of decoder layer ``layer`` (0-based), per component (V4: by its ratio)."""
        return self.layer(self.compress_ratios[layer])

    # ---- outside the layers ------------------------------------------------------------------
    def embedding(self) -> int:
        return self.vocab_size * self.hidden_size

    def hc_head(self) -> int:
        n = self.hc_mult
        return n * n * self.hidden_size + n + 1

    def head(self) -> int:
        """Output layer + final norm + HC head (the last pipeline stage's extras)."""
        return self.vocab_size * self.hidden_size + self.hidden_size + self.hc_head()

    def mtp_layer(self) -> dict[str, int]:
        """One MTP depth: a window-only layer plus its projections, norms and own HC head."""
        h = self.hidden_size
        parts = self.layer(ds4_facts.MTP_COMPRESS_RATIO)
        parts["mtp_extra"] = 2 * h + 2 * h * h + self.hc_head() + h
        return parts

    # ---- totals ------------------------------------------------------------------------------
    def decoder_total(self) -> int:
        return sum(sum(self.layer(r).values()) for r in self.compress_ratios)

    def total(self, mtp: bool = False) -> int:
        """All parameters; MTP only when ``mtp`` (DeepSeek's published totals leave it out)."""
        n = self.embedding() + self.decoder_total() + self.head()
        return n + (self.mtp_layers * sum(self.mtp_layer().values()) if mtp else 0)

    def activated(self) -> int:
        """Parameters one token activates: no input embedding, top-k of the routed experts, the head."""
        routed = sum(self.layer(r)[ROUTED] for r in self.compress_ratios)
        active_routed = len(self.compress_ratios) * self.num_experts_per_tok * self.expert()
        return self.total() - self.embedding() - routed + active_routed
