"""Every tensor of a DS4 HF checkpoint and the parameter of :class:`~.model.DS4Model` it fills.

Two on-disk name families, both read by transformers 5.10.4's ``DeepseekV4ForCausalLM``:

* ``"transformers"``: what ``DeepseekV4ForCausalLM.save_pretrained`` writes, e.g.
  ``model.layers.3.self_attn.q_a_proj.weight``, per-expert ``model.layers.3.mlp.experts.7.w1.weight``
  (w1 gate, w3 up, w2 down), ``head.weight``;
* ``"native"``: DeepSeek's release names that transformers' conversion mapping renames on load,
  e.g. ``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.7.w1.weight``, ``embed.weight``.

:func:`name_groups` lists, for one model config and family, groups ``(our names, file names, kind)``:
``copy`` (one to one), ``cat`` (our tensor = file tensors concatenated on dim 0: an expert's
``linear_fc1`` = [gate; up]) and ``split`` (our tensors = one file tensor cut on dim 0 into equal
parts: mHC ``scale[3]`` -> ``alpha_pre``, ``alpha_post``, ``alpha_res``). Conversions are pure
copies, so a load followed by a save reproduces every file tensor bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hf_mapping import HF_TO_DS4_NAMES

__all__ = ["FAMILIES", "NameGroup", "name_groups", "detect_family"]

FAMILIES = ("transformers", "native")

# transformers attention name -> DeepSeek native attention name (inverse of transformers' conversion mapping)
_NATIVE_ATTN = {
    "q_a_proj.weight": "wq_a.weight",
    "q_a_norm.weight": "q_norm.weight",
    "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight",
    "kv_norm.weight": "kv_norm.weight",
    "sinks": "attn_sink",
    "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight",
    "compressor.kv_proj.weight": "compressor.wkv.weight",
    "compressor.gate_proj.weight": "compressor.wgate.weight",
    "compressor.position_bias": "compressor.ape",
    "compressor.kv_norm.weight": "compressor.norm.weight",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}


@dataclass(frozen=True)
class NameGroup:
    ours: tuple[str, ...]
    files: tuple[str, ...]
    kind: str  # "copy" | "cat" | "split"


def _layer_groups(i: int, attn_keys: list[str], is_hash: bool, n_experts: int, native: bool) -> list[NameGroup]:
    ours = f"decoder.layers.{i}."
    if native:
        pre, attn, mlp = f"layers.{i}.", f"layers.{i}.attn.", f"layers.{i}.ffn."
        norms = {"input_layernorm": "attn_norm", "pre_mlp_layernorm": "ffn_norm"}
        hc = {"attn_hc": "hc_attn_", "mlp_hc": "hc_ffn_"}
        gate = {"weight": "gate.weight", "expert_bias": "gate.bias", "tid2eid": "gate.tid2eid"}
        shared = ("shared_experts.w1.weight", "shared_experts.w3.weight", "shared_experts.w2.weight")
    else:
        pre, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        norms = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}
        hc = {"attn_hc": "attn_hc.", "mlp_hc": "ffn_hc."}
        gate = {"weight": "gate.weight", "expert_bias": "gate.e_score_correction_bias", "tid2eid": "gate.tid2eid"}
        shared = ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")
    groups = [NameGroup((f"{ours}{k}.weight",), (f"{pre}{v}.weight",), "copy") for k, v in norms.items()]
    for k, v in hc.items():
        groups.append(NameGroup((f"{ours}{k}.mapping_proj.weight",), (f"{pre}{v}fn",), "copy"))
        groups.append(NameGroup((f"{ours}{k}.bias",), (f"{pre}{v}base",), "copy"))
        groups.append(NameGroup(tuple(f"{ours}{k}.alpha_{a}" for a in ("pre", "post", "res")), (f"{pre}{v}scale",), "split"))
    for key in attn_keys:
        file_key = _NATIVE_ATTN[key] if native else key
        groups.append(NameGroup((f"{ours}self_attention.{HF_TO_DS4_NAMES[key]}",), (attn + file_key,), "copy"))
    groups.append(NameGroup((f"{ours}mlp.router.weight",), (mlp + gate["weight"],), "copy"))
    buf = "tid2eid" if is_hash else "expert_bias"
    groups.append(NameGroup((f"{ours}mlp.router.{buf}",), (mlp + gate[buf],), "copy"))
    for e in range(n_experts):
        mine = f"{ours}mlp.experts.local_experts.{e}."
        theirs = f"{mlp}experts.{e}."
        groups.append(NameGroup((mine + "linear_fc1.weight",), (theirs + "w1.weight", theirs + "w3.weight"), "cat"))
        groups.append(NameGroup((mine + "linear_fc2.weight",), (theirs + "w2.weight",), "copy"))
    groups.append(NameGroup((f"{ours}mlp.shared_experts.linear_fc1.weight",), (mlp + shared[0], mlp + shared[1]), "cat"))
    groups.append(NameGroup((f"{ours}mlp.shared_experts.linear_fc2.weight",), (mlp + shared[2],), "copy"))
    return groups


def _attention_keys(ratio: int) -> list[str]:
    keys = [k for k in HF_TO_DS4_NAMES if not k.startswith("compressor.")]
    if ratio:
        keys += [k for k in HF_TO_DS4_NAMES if k.startswith("compressor.") and not k.startswith("compressor.indexer.")]
    if ratio == 4:
        keys += [k for k in HF_TO_DS4_NAMES if k.startswith("compressor.indexer.")]
    return keys


def name_groups(config, family: str, tied_embeddings: bool = False) -> list[NameGroup]:
    """All name groups of a model built from ``config`` (a ``DS4TransformerConfig``) in ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"checkpoint name family must be one of {FAMILIES}, got {family!r}.")
    native = family == "native"
    if native:
        top = [("embedding.word_embeddings.weight", "embed.weight"), ("decoder.final_layernorm.weight", "norm.weight"),
               ("decoder.hc_head.head_fn", "hc_head_fn"), ("decoder.hc_head.base", "hc_head_base"),
               ("decoder.hc_head.scale", "hc_head_scale")]
    else:
        top = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"), ("decoder.final_layernorm.weight", "model.norm.weight"),
               ("decoder.hc_head.head_fn", "model.hc_head.hc_fn"), ("decoder.hc_head.base", "model.hc_head.hc_base"),
               ("decoder.hc_head.scale", "model.hc_head.hc_scale")]
    if not tied_embeddings:
        top.append(("output_layer.weight", "head.weight"))
    groups = [NameGroup((o,), (f,), "copy") for o, f in top]
    for i in range(config.num_layers):
        keys = _attention_keys(int(config.csa_compress_ratios[i]))
        is_hash = config.ds4_mlp_layer_types[i] == "hash_moe"
        groups += _layer_groups(i, keys, is_hash, config.num_moe_experts, native)
    return groups


def detect_family(names) -> str:
    """``"native"`` when the names are DeepSeek's release names, else ``"transformers"``."""
    names = list(names)
    if any(n == "embed.weight" or n.startswith("layers.") for n in names):
        return "native"
    return "transformers"
