"""NeMo Automodel 0.7.0's DeepSeek-V4.1 tensors under our names (the tests and ``verl-ds4 verify --model ds41``).

:func:`reference_tensors` (the causal LM onto :class:`~verl_ds4.models.ds41.model.DS41Model`) and
:func:`dspark_reference_tensors` (the DSpark drafter onto :class:`~verl_ds4.models.ds41.dspark.DS41DSpark`)
map weights or gradients with the name tables of :mod:`verl_ds4.models.ds41.names` (experts
un-stacked and transposed, the Engram table's owner padding dropped); :func:`load_tensors` and
:func:`copy_reference_weights` copy them in.
"""

from __future__ import annotations

import torch

__all__ = ["reference_tensors", "dspark_reference_tensors", "load_tensors", "copy_reference_weights"]


def _layer_entries(put, out, src, o: str, t: str, layer) -> None:
    """One layer's (or DSpark stage's) tensors: ours under ``o``, NeMo's under ``t``."""
    from verl_ds4.models.ds41 import names

    put(o + "input_layernorm.weight", t + "attn_norm.weight")
    put(o + "pre_mlp_layernorm.weight", t + "ffn_norm.weight")
    for site, their_site in (("attn_hc", "attn_hc"), ("mlp_hc", "ffn_hc")):
        for ours_name, their_name in names.HYPER_CONNECTION.items():
            base, _, index = their_name.partition("[")
            pick = (lambda v, i=int(index[:-1]): v[i].reshape(1)) if index else (lambda v: v)
            put(f"{o}{site}.{ours_name}", f"{t}{their_site}.{base}", pick)
    for ours_name, their_name in names.ATTENTION.items():
        put(o + "self_attention." + ours_name, t + "attn." + their_name)
    if getattr(layer, "engram", None) is not None:
        rows = layer.engram.rows
        for ours_name, their_name in names.ENGRAM.items():
            put(o + "engram." + ours_name, t + "engram." + their_name, lambda v, r=rows: v[:r] if v.shape[0] > r else v)
    put(o + "mlp.router.weight", t + "ffn.gate.weight")
    put(o + "mlp.router.expert_bias", t + "ffn.gate.e_score_correction_bias")
    for e in range(len(layer.mlp.experts.local_experts)):
        put(f"{o}mlp.experts.local_experts.{e}.linear_fc1.weight", t + "ffn.experts.gate_and_up_projs", lambda v, e=e: v[e].T)
        put(f"{o}mlp.experts.local_experts.{e}.linear_fc2.weight", t + "ffn.experts.down_projs", lambda v, e=e: v[e].T)
    shared = t + "ffn.shared_experts."
    gate, up = src.get(shared + "gate_proj.weight"), src.get(shared + "up_proj.weight")
    out[o + "mlp.shared_experts.linear_fc1.weight"] = None if gate is None else torch.cat([gate, up])
    put(o + "mlp.shared_experts.linear_fc2.weight", shared + "down_proj.weight")


def _sources(theirs, grads: bool) -> dict:
    src = dict(theirs.named_parameters())
    if grads:
        return {k: v.grad for k, v in src.items()}
    src.update(dict(theirs.named_buffers()))
    return src


def _wanted(ours, grads: bool) -> dict:
    wanted = dict(ours.named_parameters())
    if not grads:
        wanted.update({k: v for k, v in ours.named_buffers() if k.endswith("router.expert_bias")})
    return wanted


def _putter(wanted, src, out):
    def put(name: str, source: str, convert=lambda t: t) -> None:
        if name in wanted:
            value = src.get(source)
            out[name] = None if value is None else convert(value)

    return put


def dspark_reference_tensors(ours, theirs, grads: bool = False) -> dict[str, torch.Tensor]:
    """NeMo's ``DeepseekV41DSparkModel`` ``theirs`` as our :class:`~verl_ds4.models.ds41.dspark.DS41DSpark`
    ``ours`` names it (weights, or with ``grads`` gradients); raises unless every one of ours has an entry."""
    src, wanted, out = _sources(theirs, grads), _wanted(ours, grads), {}
    put = _putter(wanted, src, out)
    last = len(ours.mtp.layers) - 1
    for k, stage in enumerate(ours.mtp.layers):
        o, t = f"mtp.layers.{k}.", f"mtp.{k}."
        _layer_entries(put, out, src, o, t, stage)
        if k == 0:
            put(o + "main_proj.weight", t + "main_proj.weight")
            put(o + "main_norm.weight", t + "main_norm.weight")
        if k == last:
            put(o + "final_layernorm.weight", t + "norm.weight")
            put(o + "markov_head.embed.weight", t + "markov_head.embed.weight")
            put(o + "markov_head.head.weight", t + "markov_head.head.weight")
            put(o + "confidence_head.proj.weight", t + "confidence_head.proj.weight")
    missing = sorted(set(wanted) - set(out))
    if missing:
        raise AssertionError(f"no reference tensor for {missing}")
    return out


def load_tensors(module, values: dict) -> int:
    """Copy ``values`` (our names) into ``module``'s parameters and buffers; returns how many."""
    target = dict(module.named_parameters())
    target.update(dict(module.named_buffers()))
    with torch.no_grad():
        for name, value in values.items():
            target[name].copy_(value)
    return len(values)


def reference_tensors(ours, theirs, grads: bool = False) -> dict[str, torch.Tensor]:
    """NeMo's ``DeepseekV41ForCausalLM`` ``theirs`` as our :class:`~verl_ds4.models.ds41.model.DS41Model`
    ``ours`` names it (name tables of :mod:`verl_ds4.models.ds41.names`; experts un-stacked and
    transposed): its weights, or with ``grads`` their gradients (``None`` where it has none; no
    router bias). Raises unless every one of our parameters (and router bias) has an entry."""
    src, wanted, out = _sources(theirs, grads), _wanted(ours, grads), {}
    put = _putter(wanted, src, out)

    put("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    put("decoder.final_layernorm.weight", "model.norm.weight")
    put("output_layer.weight", "lm_head.weight")
    for layer in ours.decoder.layers:
        _layer_entries(put, out, src, f"decoder.layers.{layer.layer}.", f"model.layers.{layer.layer}.", layer)
    missing = sorted(set(wanted) - set(out))
    if missing:
        raise AssertionError(f"no reference tensor for {missing}")
    return out


def copy_reference_weights(ours, theirs) -> int:
    """Copy every weight of NeMo's model ``theirs`` into our ``DS41Model`` ``ours``
    (:func:`reference_tensors`); returns how many tensors were copied."""
    return load_tensors(ours, reference_tensors(ours, theirs))
