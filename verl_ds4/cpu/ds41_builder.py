"""CPU model builder for HF ``model_type`` ``deepseek_v41``, registered with the CPU Megatron engine.

Importing this module registers ``deepseek_v41`` with the CPU engine's builder registry and, where
transformers does not know the type, :class:`~verl_ds4.models.ds41.hf_config.DeepseekV41Config` with
``AutoConfig`` (verl reads the folder's config with it). Select it with verl's per-model knob::

    model.external_lib=verl_ds4.cpu.ds41_builder

The model is :class:`verl_ds4.models.ds41.mcore_model.DS41MegatronModel` (Megatron's embedding and
output layer around the V4.1 decoder) on Megatron's CP group, built from the model folder
(``model.path``, :mod:`verl_ds4.models.ds41.folder`): ``config.json`` checked against every
``ds41_facts`` rule before a weight is read, ``tokenizer.json`` for the Engram normalisation table,
``model.safetensors`` in our names (every tensor present with its shape). ``config.json`` may be flat or
NeMo Automodel's nested one (``text_config``, ``model_type: deepseek_v41_text``, YaRN as transformers 5's
``rope_parameters``); RoPE it cannot read unambiguously, or a key a built-in value would fill, is refused
(``ds41_facts``). verl's critic
(``value_model``) gets ``DS41MegatronModel(value_head=True)`` (hidden -> 1, seeded; the folder's LM
head is not loaded). ``engine.dist_checkpointing_path`` (loaded by the engine afterwards) still wins.

Refused at start-up, with the field and the fix: a folder that is not V4.1 (or breaks a rule), a
zigzag CP split (``DS41TransformerConfig``), ``model.mtp.enable=true`` on a folder whose ``mtp.*``
is a DSpark drafter (the CPU model does not train it), override keys that are not
``TransformerConfig`` fields, a ``model.override_config`` value the builder would not see (it builds
from ``config.json``; verl's object is compared with it level by level, so the top-level keys a nested
``config.json`` repeats are not taken for overrides).

verl's router replay (``router_replay.mode`` R2 / R3): every layer's router (V4's ``DS4Router``; V4.1
has score routers only, no ``hash_moe`` layers) gets a verl ``RouterReplay`` and its 1-based
``layer_number`` (:func:`verl_ds4.models.ds4.router_replay.enable_router_replay`), as V4's builder does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from verl_ds4.cpu.builders import CPUModelBuilder, register_cpu_model_builder
from verl_ds4.cpu.ds4_builder import model_folder_of
from verl_ds4.models.ds41.hf_config import register_auto_config

__all__ = ["DS41_CPU_BUILDER", "ds41_folder_of"]

#: Seed of the critic's value head (the folder has an LM head only).
DS41_VALUE_HEAD_SEED = 4142


def ds41_folder_of(hf_config) -> tuple[Path, dict]:
    """The V4.1 model folder of ``hf_config`` and its checked ``config.json`` (``ValueError`` with the fix)."""
    from verl_ds4.models.ds41.folder import read_folder_config

    folder = model_folder_of(hf_config)
    if folder is None:
        raise ValueError(
            f"model.path must be a local DeepSeek-V4.1 folder (config.json, model.safetensors, tokenizer.json); "
            f"the HF config came from {getattr(hf_config, '_name_or_path', None)!r}. Write one with "
            "python -m verl_ds4.cpu.sft_data --model ds41 --out DIR, or verl_ds4.models.ds41.folder.save_folder."
        )
    config = read_folder_config(folder)
    from verl_ds4 import ds41_facts

    # verl zeroes num_nextn_predict_layers on its config object when model.mtp.enable is false.
    mtp_on = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0) > 0
    problem = ds41_facts.check_v4_mtp(config, mtp_on, key="model.mtp.enable")
    if problem:
        raise ValueError(problem.engine_message())
    changed = _changed_by_verl_overrides(hf_config, config)
    if changed:
        raise ValueError(
            "model.override_config changes " + ", ".join(f"{k}={seen!r} (config.json: {v!r})" for k, seen, v in changed)
            + f", but the DeepSeek-V4.1 builder builds from {folder / 'config.json'} and would ignore it: "
            "remove the override, or write the value into the folder's config.json."
        )
    return folder, config


#: Keys verl sets on its config object itself (the tokenizer's ids; MTP off zeroes the stage count).
_SET_BY_VERL = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "num_nextn_predict_layers"})


def _changed_by_verl_overrides(hf_config, config: dict) -> list[tuple[str, object, object]]:
    """``(key, value on verl's config object, value in config.json)`` for every text key they disagree on."""
    from verl_ds4 import ds41_facts

    attrs = getattr(hf_config, "__dict__", {})
    nested = attrs.get("text_config") if isinstance(attrs.get("text_config"), dict) else {}
    # A nested config.json (NeMo Automodel's save_pretrained) repeats some keys at its top level (model_type
    # deepseek_v41 beside the text's deepseek_v41_text, the token ids, dtype): a top-level attribute is an
    # override only where it differs from the top level of config.json.
    top = {k: v for k, v in config.items() if k != "text_config"} if "text_config" in config else {}
    changed = []
    for key, value in ds41_facts.text_config(config).items():
        # transformers renames rope_scaling / rope_parameters on its object and takes dtype / torch_dtype for
        # itself (the model's dtype comes from verl's engine settings, not config.json).
        if key in _SET_BY_VERL or key in ("model_type", "rope_scaling", "rope_parameters", "dtype", "torch_dtype"):
            continue
        if key in attrs and not (key in top and attrs[key] == top[key]):
            seen = attrs[key]
        elif key in nested:
            seen = nested[key]
        else:
            continue
        if seen != value:
            changed.append((key, seen, value))
    return changed


def _ds41_transformer_config(hf_config, dtype, overrides):
    from megatron.core import parallel_state as mpu

    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds41.mcore_model import DS41TransformerConfig, ds41_transformer_config

    _, config = ds41_folder_of(hf_config)
    known = {f.name for f in dataclasses.fields(DS41TransformerConfig)}
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ValueError(
            f"engine.override_transformer_config keys {unknown} are not fields of {DS41TransformerConfig.__name__}; remove them."
        )
    overrides = dict(overrides)
    # Layers differ in shape (compressors at ratio 1 / 2, none at 0; Engram on some): Megatron's
    # dist-checkpointing keys each layer separately (field name as spelled in megatron-core).
    overrides.setdefault("hetereogenous_dist_checkpoint", True)
    text = ds41_facts.text_config(config)
    config = ds41_transformer_config(text, dtype=dtype, cp_size=mpu.get_context_parallel_world_size())
    return dataclasses.replace(config, **overrides)  # checked again (__post_init__): a zigzag split is refused


def _ds41_build(tf_config, hf_config, *, pre_process, post_process, share_embeddings, value_head: bool = False):
    import torch
    from transformers import PreTrainedTokenizerFast

    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.released import load_checked
    from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, DS41TransformerConfig

    if not isinstance(tf_config, DS41TransformerConfig):
        raise TypeError(f"The DS41 builder needs a DS41TransformerConfig, got {type(tf_config).__name__}.")  # error-catalogue: internal: verl passed another config class
    if not (pre_process and post_process):
        raise ValueError("The CPU DeepSeek-V4.1 model runs at pipeline_model_parallel_size=1.")
    if share_embeddings:
        raise ValueError("DeepSeek-V4.1 has separate embedding and LM head: set tie_word_embeddings=false in config.json.")
    folder, config = ds41_folder_of(hf_config)
    table = None
    if ds41_facts.read_config(config).engram_layers:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / ds41_facts.TOKENIZER_FILE))
        table = engram_token_map(tokenizer)[0]
    model = DS41MegatronModel(tf_config, token_map=table, value_head=value_head)
    # Every rule (quantisation config, scale grids, names, decoded shapes) on the safetensors headers first.
    skip = {"output_layer.weight"} if value_head else set()
    style, skipped = load_checked(model, folder, config, skip=skip)
    with torch.no_grad():
        if value_head:
            gen = torch.Generator().manual_seed(DS41_VALUE_HEAD_SEED)
            head = model.output_layer.weight
            std = float(config.get("initializer_range", 0.02))
            head.copy_((std * torch.randn(head.shape, generator=gen, dtype=torch.float64)).to(head.dtype))
    from verl_ds4.models.ds4.router_replay import enable_router_replay, routing_replay_requested

    if routing_replay_requested(tf_config):  # verl's router_replay.mode R2 / R3: every layer's V4 DS4Router
        enable_router_replay(model)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        head = "value head (hidden -> 1, seeded)" if value_head else "LM head"
        print(f"[verl-ds4 cpu] DeepSeek-V4.1 model ({tf_config.num_layers} layers, ratios "
              f"{list(ds41_facts.read_config(config).compress_ratios)}, Engram {list(ds41_facts.read_config(config).engram_layers)}, "
              f"{head}): weights from {folder} ({style} names"
              + "".join(f"; not loaded: {n} {what}" for what, n in skipped.items()) + ")")  # fmt: skip
    return model


#: HF model_type deepseek_v41: DS41MegatronModel from a V4.1 folder in our names (LM head or critic).
DS41_CPU_BUILDER = CPUModelBuilder(_ds41_transformer_config, _ds41_build, builds_value_head=True)
register_cpu_model_builder("deepseek_v41", DS41_CPU_BUILDER)
register_auto_config()
