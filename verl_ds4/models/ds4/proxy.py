"""The tiny DS4 proxy: a real Megatron-Core ``GPTModel`` whose attention is DS4's, runnable on CPU.

    from verl_ds4.models.ds4.proxy import build_proxy_model, load_proxy_config
    model = build_proxy_model(dtype=torch.float64)                 # LM head: logits [b, s, vocab]
    critic = build_proxy_model(dtype=torch.float64, value_head=True)   # values [b, s, 1]

The sizes come from ``configs/tiny_proxy.json`` (shipped in the package) or any dict / JSON path
with the same keys. Megatron's parallel state must be initialised first (tensor and pipeline
parallel size 1, any context-parallel size). Weights are drawn from a seeded generator over the
parameters in name order, so every rank and every CP size builds bit-identical models.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .mcore_attention import DS4HybridSelfAttention, DS4ProxyTransformerConfig, cpu_ds4_settings

__all__ = ["load_proxy_config", "proxy_transformer_config", "ds4_layer_spec", "ds4_gpt_model", "build_proxy_model", "ValueHead", "reset_parameters"]

REQUIRED_KEYS = (
    "vocab_size hidden_size ffn_hidden_size num_attention_heads head_dim rope_dim q_lora_rank o_groups "
    "o_lora_rank compress_ratios window_size index_n_heads index_head_dim index_topk"
).split()


def load_proxy_config(source: str | Path | dict | None = None) -> dict[str, Any]:
    """The proxy's sizes: the packaged tiny config, a JSON file, or a dict (validated)."""
    if source is None:
        text = resources.files("verl_ds4.models.ds4").joinpath("configs/tiny_proxy.json").read_text()
        cfg = json.loads(text)
    elif isinstance(source, dict):
        cfg = dict(source)
    else:
        cfg = json.loads(Path(source).read_text())
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"DS4 proxy config lacks {missing}; see verl_ds4/models/ds4/configs/tiny_proxy.json for all keys.")
    return cfg


def proxy_transformer_config(cfg: dict, dtype: torch.dtype = torch.float32, cp_size: int | None = None) -> DS4ProxyTransformerConfig:
    """A CPU-ready ``DS4ProxyTransformerConfig`` for the proxy sizes ``cfg``."""
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"proxy dtype must be float32, float64 or bfloat16, got {dtype}.")
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    return DS4ProxyTransformerConfig(
        num_layers=len(cfg["compress_ratios"]),
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["ffn_hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        kv_channels=cfg["head_dim"],
        layernorm_epsilon=cfg.get("norm_epsilon", 1e-6),
        **cpu_ds4_settings(dtype, cp_size),
        csa_compress_ratios=list(cfg["compress_ratios"]),
        csa_window_size=cfg["window_size"],
        q_lora_rank=cfg["q_lora_rank"],
        o_groups=cfg["o_groups"],
        o_lora_rank=cfg["o_lora_rank"],
        qk_pos_emb_head_dim=cfg["rope_dim"],
        dsa_indexer_n_heads=cfg["index_n_heads"],
        dsa_indexer_head_dim=cfg["index_head_dim"],
        dsa_indexer_topk=cfg["index_topk"],
        rotary_base=cfg.get("rope_theta", 10000.0),
        csa_compress_rotary_base=cfg.get("compress_rope_theta", 160000.0),
        rotary_scaling_factor=cfg.get("yarn_factor", 16.0),
        original_max_position_embeddings=cfg.get("yarn_original_max_position_embeddings", 65536),
        beta_fast=cfg.get("yarn_beta_fast", 32.0),
        beta_slow=cfg.get("yarn_beta_slow", 1.0),
    )


def ds4_layer_spec(config: DS4ProxyTransformerConfig) -> ModuleSpec:
    """Megatron-Core's local GPT layer spec (RMSNorm, dense MLP) with DS4 attention as ``self_attention``."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.self_attention = ModuleSpec(module=DS4HybridSelfAttention)
    return spec


class ValueHead(torch.nn.Linear):
    """Critic output layer (hidden -> 1) in place of ``GPTModel.output_layer``, as verl's value model does.

    Returns ``(values, None)`` like Megatron's output layer; values are at least float32 (verl
    upcasts bf16 values) and keep float64 in an fp64 model.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__(hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = super().forward(hidden_states)
        if values.dtype not in (torch.float32, torch.float64):
            values = values.float()
        return values, None


def reset_parameters(model: torch.nn.Module, seed: int, std: float) -> None:
    """Deterministic weights: norm scales ``1 + std/2 * N(0,1)``, everything else ``std * N(0,1)``
    (fan-in scaled for matrices), drawn in parameter-name order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if "norm" in name and param.dim() == 1:
                value = 1.0 + 0.5 * std * noise
            elif param.dim() >= 2:
                value = noise * (std if "embedding" in name else param.shape[-1] ** -0.5)
            else:
                value = std * noise
            param.copy_(value.to(param.dtype))


def ds4_gpt_model(
    config: DS4ProxyTransformerConfig,
    sizes: dict,
    *,
    seed: int,
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    value_head: bool = False,
) -> GPTModel:
    """The proxy's ``GPTModel`` (DS4 layers, no position embedding; ``sizes``: its ``vocab_size``
    and optional ``max_sequence_length`` / ``init_std``), in ``config.params_dtype``, initialised
    from ``seed``; ``value_head=True`` swaps the LM output layer for a :class:`ValueHead` first."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=ds4_layer_spec(config),
        vocab_size=sizes["vocab_size"],
        max_sequence_length=sizes.get("max_sequence_length", 8192),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="none",
    )
    if value_head:
        model.output_layer = ValueHead(config.hidden_size, config.params_dtype)
    for param in model.parameters():  # Megatron's torch-norm fallback ignores params_dtype
        param.data = param.data.to(config.params_dtype)
    reset_parameters(model, seed=seed, std=float(sizes.get("init_std", 0.2)))
    return model


def build_proxy_model(
    cfg: dict | str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    seed: int = 1234,
) -> GPTModel:
    """A real Megatron-Core ``GPTModel`` with DS4 attention, on CPU, in ``dtype``.

    ``value_head=True`` swaps the LM output layer for a hidden -> 1 :class:`ValueHead` (verl's critic).
    """
    cfg = load_proxy_config(cfg)
    config = proxy_transformer_config(cfg, dtype=dtype)
    return ds4_gpt_model(config, cfg, seed=seed, value_head=value_head)
