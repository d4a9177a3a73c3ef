"""CPU model builder for the tiny DS4 proxy, registered with the CPU Megatron engine.

verl's CPU Megatron engine (:mod:`verl_ds4.cpu.engine`) builds models by HF ``model_type``.
Importing this module registers ``deepseek_v4`` -> the tiny DS4 proxy (a Megatron-Core
``GPTModel`` with verl-ds4's pure-PyTorch DS4 attention, :mod:`verl_ds4.models.ds4.proxy`).
Select it with verl's own per-model import knob::

    model.external_lib=verl_ds4.cpu.ds4_builder

The model folder's ``config.json`` is an HF ``DeepseekV4Config`` whose attribute
``verl_ds4_proxy`` holds the proxy sizes (written by
``verl_ds4.cpu.sft_data.ds4_proxy_hf_config``). A full DeepSeek-V4 checkpoint has no
such entry and is rejected with an error: it needs Megatron-LM dev and GPUs.
"""

from __future__ import annotations

from verl_ds4.cpu.builders import CPUModelBuilder, register_cpu_model_builder

__all__ = ["DS4_PROXY_CONFIG_ATTRIBUTE", "DS4_PROXY_CPU_BUILDER"]


#: HF config attribute holding the DS4 proxy's sizes (the keys of verl_ds4/models/ds4/configs/tiny_proxy.json).
DS4_PROXY_CONFIG_ATTRIBUTE = "verl_ds4_proxy"


def _ds4_proxy_sizes(hf_config) -> dict:
    from verl_ds4.models.ds4.proxy import load_proxy_config

    sizes = getattr(hf_config, DS4_PROXY_CONFIG_ATTRIBUTE, None)
    if not isinstance(sizes, dict):
        raise ValueError(
            f"This deepseek_v4 config has no '{DS4_PROXY_CONFIG_ATTRIBUTE}' entry: on CPU only the tiny DS4 proxy can be "
            "built (a full DeepSeek-V4 needs Megatron-LM dev and GPUs). Write the model folder with "
            "verl_ds4.cpu.sft_data.ds4_proxy_hf_config()."
        )
    return load_proxy_config(sizes)


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


#: The tiny DS4 proxy (DS4 hybrid attention in a Megatron-Core GPTModel): HF model_type deepseek_v4.
DS4_PROXY_CPU_BUILDER = CPUModelBuilder(_ds4_proxy_transformer_config, _ds4_proxy_build)
register_cpu_model_builder("deepseek_v4", DS4_PROXY_CPU_BUILDER)
