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

MTP depth ``k`` (``mtp.layers.k.*`` here) reads DeepSeek's native ``mtp.k.*`` names in both
families: ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, ``hc_head_{fn,base,scale}`` and one
window-only decoder layer in native layer names (``mtp.k.attn.wq_a.weight``, ``mtp.k.ffn.*``,
``mtp.k.hc_attn_fn``, ...), as Megatron-LM dev's DS4 checkpoint mapping names them.
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


def _layer_groups(i: int, attn_keys: list[str], is_hash: bool, n_experts: int, native: bool,
                  ours: str | None = None, native_prefix: str | None = None) -> list[NameGroup]:
    ours = ours or f"decoder.layers.{i}."
    if native:
        p = native_prefix or f"layers.{i}."
        pre, attn, mlp = p, f"{p}attn.", f"{p}ffn."
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
    for k in range(int(getattr(config, "mtp_num_layers", None) or 0)):
        groups += _mtp_groups(k, config.num_moe_experts)
    return groups


def _mtp_groups(k: int, n_experts: int) -> list[NameGroup]:
    """MTP depth ``k``: DeepSeek's native ``mtp.k.*`` names in *both* families (transformers builds no
    MTP; its conversion mapping leaves ``mtp.*`` untouched and its loader ignores them)."""
    ours, theirs = f"mtp.layers.{k}.", f"mtp.{k}."
    top = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("e_proj.weight", "e_proj.weight"),
           ("h_proj.weight", "h_proj.weight"), ("final_layernorm.weight", "norm.weight"),
           ("hc_head.head_fn", "hc_head_fn"), ("hc_head.base", "hc_head_base"), ("hc_head.scale", "hc_head_scale")]
    groups = [NameGroup((ours + o,), (theirs + f,), "copy") for o, f in top]
    # The inner layer: window-only attention (no compressor / indexer), a top-k (not hash) MoE.
    return groups + _layer_groups(k, _attention_keys(0), False, n_experts, True, ours=f"{ours}mtp_model_layer.", native_prefix=theirs)


def detect_family(names) -> str:
    """``"native"`` when the names are DeepSeek's release names, else ``"transformers"``."""
    names = list(names)
    if any(n == "embed.weight" or n.startswith("layers.") for n in names):
        return "native"
    return "transformers"
