"""CPU model builder for HF ``model_type`` ``deepseek_v4``, registered with the CPU Megatron engine.

verl's CPU Megatron engine (:mod:`verl_ds4.cpu.engine`) builds models by HF ``model_type``.
Importing this module registers ``deepseek_v4``; select it with verl's per-model import knob::

    model.external_lib=verl_ds4.cpu.ds4_builder

The folder's ``config.json`` decides which model is built:

* a DeepSeek-V4 config (``DeepseekV4Config``, no ``verl_ds4_proxy`` entry): the full DS4,
  :class:`verl_ds4.models.ds4.model.DS4Model` (mHC, DS4 attention, DS4 MoE with hash layers).
  Its weights are the folder's safetensors when it has them (transformers' or DeepSeek's names,
  every tensor checked, :func:`verl_ds4.models.ds4.hf_checkpoint.load_into`), else a seeded init.
  ``engine.dist_checkpointing_path`` (loaded by the engine afterwards) still wins. With verl's
  router replay on (``router_replay.mode`` R2 / R3) every router, hash layers included, gets a verl
  ``RouterReplay`` (:mod:`verl_ds4.models.ds4.router_replay`).
* a config with the attribute ``verl_ds4_proxy`` (the proxy's sizes, written by
  ``verl_ds4.cpu.sft_data.ds4_proxy_hf_config``): the attention-only DS4 proxy
  (:mod:`verl_ds4.models.ds4.proxy`: DS4 attention, dense SwiGLU MLP, no mHC, no MoE), seeded init.
"""

from __future__ import annotations

from verl_ds4.cpu.builders import CPUModelBuilder, register_cpu_model_builder

from pathlib import Path

__all__ = ["DS4_CPU_BUILDER", "DS4_PROXY_CONFIG_ATTRIBUTE", "DS4_PROXY_CPU_BUILDER", "is_ds4_proxy_config", "model_folder_of"]


#: HF config attribute holding the DS4 proxy's sizes (the keys of verl_ds4/models/ds4/configs/tiny_proxy.json).
DS4_PROXY_CONFIG_ATTRIBUTE = "verl_ds4_proxy"


def _ds4_proxy_sizes(hf_config) -> dict:
    from verl_ds4.models.ds4.proxy import load_proxy_config

    sizes = getattr(hf_config, DS4_PROXY_CONFIG_ATTRIBUTE, None)
    if not isinstance(sizes, dict):
        raise ValueError(
            f"This deepseek_v4 config has no '{DS4_PROXY_CONFIG_ATTRIBUTE}' entry, so it is not the DS4 proxy's config; "
            "build it with DS4_CPU_BUILDER (the full DS4), or write a proxy folder with "
            "verl_ds4.cpu.sft_data.ds4_proxy_hf_config()."
        )
    return load_proxy_config(sizes)


def is_ds4_proxy_config(hf_config) -> bool:
    """True for the attention-only proxy's config (it carries ``verl_ds4_proxy``), False for a DS4 config."""
    return isinstance(getattr(hf_config, DS4_PROXY_CONFIG_ATTRIBUTE, None), dict)


def _ds4_transformer_config(hf_config, dtype, overrides):
    if is_ds4_proxy_config(hf_config):
        return _ds4_proxy_transformer_config(hf_config, dtype, overrides)
    from megatron.core import parallel_state as mpu

    from verl_ds4.models.ds4.hf_checkpoint import read_config
    from verl_ds4.models.ds4.model_config import ds4_transformer_config

    folder = model_folder_of(hf_config)
    if folder is not None and (folder / "config.json").is_file():
        read_config(folder)  # the folder's config.json as written (nested, RoPE): refused with the fix
    overrides = dict(overrides)
    overrides.setdefault("hetereogenous_dist_checkpoint", True)  # layers differ in shape (see the proxy's note)
    return ds4_transformer_config(hf_config, dtype=dtype, cp_size=mpu.get_context_parallel_world_size(), **overrides)


def model_folder_of(hf_config) -> Path | None:
    """The local folder ``hf_config`` was read from (``_name_or_path``), if it is one."""
    name = getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)
    if not name or not Path(str(name)).is_dir():
        return None
    return Path(str(name))


def _ds4_build(tf_config, hf_config, *, pre_process, post_process, share_embeddings):
    if is_ds4_proxy_config(hf_config):
        return _ds4_proxy_build(tf_config, hf_config, pre_process=pre_process, post_process=post_process, share_embeddings=share_embeddings)
    import torch

    from verl_ds4.models.ds4.hf_checkpoint import load_into, read_hf_tensors
    from verl_ds4.models.ds4.model import DS4Model, init_ds4_weights
    from verl_ds4.models.ds4.model_config import DS4TransformerConfig

    if not isinstance(tf_config, DS4TransformerConfig):
        raise TypeError(f"The DS4 builder needs a DS4TransformerConfig, got {type(tf_config).__name__}.")  # error-catalogue: internal: verl passed another config class
    model = DS4Model(
        tf_config,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
    )
    init_ds4_weights(model, seed=DS4_SEED, std=float(hf_config.initializer_range))
    folder = model_folder_of(hf_config)
    has_weights = folder is not None and any(folder.glob("*.safetensors"))
    if has_weights:
        load_into(model, read_hf_tensors(folder), folder=folder)
    from verl_ds4.models.ds4.router_replay import enable_router_replay, routing_replay_requested

    if routing_replay_requested(tf_config):  # verl's router_replay.mode != disabled (R2 / R3)
        enable_router_replay(model)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        source = f"the safetensors of {folder}" if has_weights else f"a seeded init (seed {DS4_SEED}; no safetensors in the model folder)"
        print(f"[verl-ds4 cpu] DS4 model ({tf_config.num_layers} layers, {tf_config.num_moe_experts} experts): weights from {source}")
    return model


#: Seed of the full DS4's init when the folder has no weights (the same on every rank).
DS4_SEED = 1234


def _ds4_proxy_transformer_config(hf_config, dtype, overrides):
    import dataclasses

    from megatron.core import parallel_state as mpu

    from verl_ds4.models.ds4.proxy import proxy_transformer_config

    config = proxy_transformer_config(
        _ds4_proxy_sizes(hf_config), dtype=dtype, cp_size=mpu.get_context_parallel_world_size()
    )
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ValueError(
            f"engine.override_transformer_config keys {unknown} are not fields of the DS4 proxy's TransformerConfig "
            f"({type(config).__name__}); remove them."
        )
    if "hetereogenous_dist_checkpoint" not in overrides and len(set(config.csa_compress_ratios)) > 1:
        # DS4 layers differ by compression ratio (different compressor shapes, none at ratio 0),
        # so Megatron's dist-checkpointing must key each layer separately (field name as spelled
        # in megatron-core).
        overrides = {**overrides, "hetereogenous_dist_checkpoint": True}
    return dataclasses.replace(config, **overrides)


def _ds4_proxy_build(tf_config, hf_config, *, pre_process, post_process, share_embeddings):
    from verl_ds4.models.ds4.proxy import ds4_gpt_model

    sizes = _ds4_proxy_sizes(hf_config)
    if sizes["vocab_size"] < hf_config.vocab_size:
        raise ValueError(
            f"DS4 proxy vocab_size={sizes['vocab_size']} is smaller than the HF config's vocab_size={hf_config.vocab_size}."
        )
    model = ds4_gpt_model(
        tf_config,
        sizes,
        seed=int(sizes.get("seed", 1234)),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings=share_embeddings,
    )
    return model


#: The tiny DS4 proxy only (DS4 hybrid attention in a Megatron-Core GPTModel).
DS4_PROXY_CPU_BUILDER = CPUModelBuilder(_ds4_proxy_transformer_config, _ds4_proxy_build)
#: HF model_type deepseek_v4: the full DS4, or the proxy when the config says it is one.
DS4_CPU_BUILDER = CPUModelBuilder(_ds4_transformer_config, _ds4_build)
register_cpu_model_builder("deepseek_v4", DS4_CPU_BUILDER)
