"""The full DS4 model's ``TransformerConfig`` and its construction from an HF ``DeepseekV4Config``.

    from verl_ds4.models.ds4.model_config import ds4_transformer_config
    config = ds4_transformer_config(hf_config, dtype=torch.float64, cp_size=2)

:class:`DS4TransformerConfig` extends the attention config (:class:`DS4ProxyTransformerConfig`)
with mHC (Megatron-LM dev's names: ``num_residual_streams``, ``mhc_sinkhorn_iterations``,
``mhc_epsilon``) and the MoE (Megatron-Core's ``num_moe_experts``, ``moe_ffn_hidden_size``,
``moe_router_topk``, ``moe_shared_expert_intermediate_size``, ``moe_router_topk_scaling_factor``;
DS4-only: ``ds4_router_score_function``, ``ds4_norm_topk_prob``, ``ds4_swiglu_limit``,
``ds4_mlp_layer_types``). Megatron-Core 0.16.1's own ``moe_router_score_function`` admits
softmax / sigmoid only and its expert bias requires sigmoid, so DS4's router keeps its own fields.

Every HF config value this CPU model does not implement raises :class:`UnsupportedDS4Config`
naming it (see :data:`UNSUPPORTED_CHECKS`), before any weight exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from verl_ds4 import ds41_facts

from .mcore_attention import DS4ProxyTransformerConfig, cpu_ds4_settings

__all__ = ["DS4TransformerConfig", "UnsupportedDS4Config", "hf_config_object", "ds4_transformer_config", "MLP_LAYER_TYPES"]

MLP_LAYER_TYPES = ("moe", "hash_moe")
_RATIO_KEYS = {"compressed_sparse_attention", "heavily_compressed_attention"}


class UnsupportedDS4Config(ValueError):
    """An HF DeepSeek-V4 config value the CPU model does not implement."""


@dataclass
class DS4TransformerConfig(DS4ProxyTransformerConfig):
    """Attention sizes (parent) + mHC + DS4 MoE; ``vocab_size`` sizes the hash tables."""

    num_residual_streams: int = 4  # HF hc_mult
    mhc_sinkhorn_iterations: int = 20  # HF hc_sinkhorn_iters
    mhc_epsilon: float = 1e-6  # HF hc_eps
    ds4_router_score_function: str = "sqrtsoftplus"  # HF scoring_func
    ds4_norm_topk_prob: bool = True
    ds4_swiglu_limit: float | None = 10.0
    ds4_mlp_layer_types: list[str] = field(default_factory=lambda: ["moe"])
    ds4_vocab_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        if len(self.ds4_mlp_layer_types) != self.num_layers:
            raise ValueError(
                f"ds4_mlp_layer_types has {len(self.ds4_mlp_layer_types)} entries for num_layers={self.num_layers}."
            )
        bad = sorted(set(self.ds4_mlp_layer_types) - set(MLP_LAYER_TYPES))
        if bad:
            raise ValueError(f"ds4_mlp_layer_types entries must be in {MLP_LAYER_TYPES}, got {bad}.")
        if not self.num_moe_experts or not self.moe_router_topk:
            raise ValueError("DS4 needs num_moe_experts and moe_router_topk (every DS4 layer is an MoE layer).")
        if "hash_moe" in self.ds4_mlp_layer_types and self.ds4_vocab_size < 1:
            raise ValueError("hash_moe layers need ds4_vocab_size (rows of the tid2eid table).")


def hf_config_object(hf_config: Any):
    """A transformers ``DeepseekV4Config`` from a config object, a ``config.json`` dict or its path."""
    from transformers import DeepseekV4Config

    if isinstance(hf_config, DeepseekV4Config):
        return hf_config
    if isinstance(hf_config, Mapping):
        data = dict(hf_config)
    elif hasattr(hf_config, "to_dict"):
        data = hf_config.to_dict()
    else:
        import json
        from pathlib import Path

        path = Path(hf_config)
        data = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    refused = ds41_facts.check_model_type(data, "ds4")
    if refused:
        raise ValueError(refused.engine_message())
    model_type = data.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ValueError(f"Expected an HF config with model_type 'deepseek_v4', got {model_type!r}.")
    data.pop("model_type", None)
    return DeepseekV4Config(**data)


def _unsupported(cfg, allow_mtp_skip: bool) -> list[str]:
    """Names (and values) of config entries this model does not implement."""
    problems = []

    def check(ok: bool, name: str, want: str):
        if not ok:
            problems.append(f"{name}={getattr(cfg, name, None)!r} (supported: {want})")

    check(int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) >= 0, "num_nextn_predict_layers", ">= 0")
    check(cfg.hidden_act == "silu", "hidden_act", "'silu'")
    check(not cfg.attention_bias, "attention_bias", "False")
    check(not cfg.mlp_bias, "mlp_bias", "False")
    check(float(cfg.attention_dropout or 0.0) == 0.0, "attention_dropout", "0.0")
    check(float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) == 0.0, "router_jitter_noise", "0.0")
    check(int(cfg.n_shared_experts) == 1, "n_shared_experts", "1 (transformers builds exactly one shared expert)")
    check(int(cfg.num_key_value_heads) == 1, "num_key_value_heads", "1 (DS4 attention is MQA)")
    check(getattr(cfg, "quantization_config", None) is None, "quantization_config", "None (dequantise FP8 checkpoints first)")
    check(cfg.rope_parameters["main"].get("rope_type", "default") == "default", "rope_parameters['main']", "rope_type 'default'")
    check(set(cfg.compress_rates) <= _RATIO_KEYS, "compress_rates", f"keys in {sorted(_RATIO_KEYS)}")
    return problems


def ds4_transformer_config(
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    cp_size: int | None = None,
    allow_mtp_skip: bool = False,
    **overrides,
) -> DS4TransformerConfig:
    """The CPU-ready :class:`DS4TransformerConfig` of an HF DeepSeek-V4 config (object, dict or path).

    ``num_nextn_predict_layers > 0`` sets ``mtp_num_layers`` (the model builds its MTP block) unless
    ``allow_mtp_skip`` (then ``None``: no MTP, as transformers). ``cp_size`` defaults to Megatron's initialised CP size (1 when uninitialised); ``overrides`` are
    ``TransformerConfig`` fields applied last (unknown names raise).
    """
    from megatron.core import parallel_state

    from .hf_mapping import spec_from_hf_config

    cfg = hf_config_object(hf_config)
    mtp_on = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) > 0 and not allow_mtp_skip
    refused = ds41_facts.check_v4_mtp(cfg, mtp_on, key="num_nextn_predict_layers", off="allow_mtp_skip=True")
    if refused:
        raise ValueError(refused.engine_message())
    problems = _unsupported(cfg, allow_mtp_skip)
    if problems:
        raise UnsupportedDS4Config("This DeepSeek-V4 config uses values the CPU DS4 model does not implement: " + "; ".join(problems) + ".")
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"DS4 model dtype must be float32, float64 or bfloat16, got {dtype}.")
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    specs = [spec_from_hf_config(cfg, i) for i in range(cfg.num_hidden_layers)]
    s0 = specs[0]
    yarn = next((s for s in specs if s.kind != "sliding"), s0)
    config = DS4TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.moe_intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        layernorm_epsilon=cfg.rms_norm_eps,
        **cpu_ds4_settings(dtype, cp_size),
        csa_compress_ratios=[s.compress_ratio for s in specs],
        csa_window_size=s0.window_size,
        q_lora_rank=s0.q_lora_rank,
        o_groups=s0.o_groups,
        o_lora_rank=s0.o_lora_rank,
        qk_pos_emb_head_dim=s0.rope_dim,
        dsa_indexer_n_heads=s0.index_n_heads,
        dsa_indexer_head_dim=s0.index_head_dim,
        dsa_indexer_topk=s0.index_topk,
        rotary_base=s0.rope_theta,
        csa_compress_rotary_base=yarn.compress_rope_theta,
        rotary_scaling_factor=yarn.yarn_factor,
        original_max_position_embeddings=yarn.yarn_original_max_position_embeddings,
        beta_fast=yarn.yarn_beta_fast,
        beta_slow=yarn.yarn_beta_slow,
        num_residual_streams=cfg.hc_mult,
        mhc_sinkhorn_iterations=cfg.hc_sinkhorn_iters,
        mhc_epsilon=cfg.hc_eps,
        num_moe_experts=cfg.n_routed_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
        ds4_router_score_function=cfg.scoring_func,
        ds4_norm_topk_prob=bool(cfg.norm_topk_prob),
        ds4_swiglu_limit=None if cfg.swiglu_limit is None else float(cfg.swiglu_limit),
        ds4_mlp_layer_types=list(cfg.mlp_layer_types),
        ds4_vocab_size=cfg.vocab_size,
        # MTP (mtp.py): None when the config has none or allow_mtp_skip drops it; the loss weight
        # is TransformerConfig's mtp_loss_scaling_factor (0.1, as Megatron-LM dev's DS4 recipes).
        mtp_num_layers=(int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) or None) if not allow_mtp_skip else None,
    )
    if overrides:
        known = {f.name for f in dataclasses.fields(config)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"override keys {unknown} are not fields of DS4TransformerConfig; remove them.")
        config = dataclasses.replace(config, **overrides)
    return config
