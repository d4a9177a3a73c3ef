"""``sparse_attention=linear`` at engine start-up: refused with the fused kernels, put into Megatron-LM dev's DS4
layers on GPU engines (refused with the fix where that Megatron is missing), and into the CPU model's own attention
modules on CPU engines (refused for a model without one)."""

from __future__ import annotations

import types

import pytest
import torch

from verl_ds4.engine.config import DS4McoreEngineConfig
from verl_ds4.engine.megatron import _ResolvedLayoutEngine
from verl_ds4.mcore import sparse_attention_patch


def _config(**kw):
    return DS4McoreEngineConfig(**kw)


def _engine(in_megatron: bool, config=None):
    return types.SimpleNamespace(sparse_attention_in_megatron=in_megatron, engine_config=config)


def test_linear_with_the_fused_kernels_is_refused():
    cfg = _config(sparse_attention="linear", override_transformer_config={"dsa_kernel_backend": "cudnn"})
    with pytest.raises(ValueError, match="dsa_kernel_backend='cudnn' runs the fused kernels, which do not use it"):
        _ResolvedLayoutEngine._prepare_sparse_attention(_engine(True), cfg)
    # control: the default core with the fused kernels is fine, and nothing is patched
    _ResolvedLayoutEngine._prepare_sparse_attention(_engine(True), _config(override_transformer_config={"dsa_kernel_backend": "cudnn"}))
    assert not sparse_attention_patch.installed()


def test_a_gpu_engine_without_megatron_dev_is_refused_at_start_up():
    cfg = _config(sparse_attention="linear", override_transformer_config={"dsa_kernel_backend": "none"})
    with pytest.raises(sparse_attention_patch.SparseAttentionPatchError, match="set ds4.sparse_attention=megatron"):
        _ResolvedLayoutEngine._prepare_sparse_attention(_engine(True), cfg)
    _ResolvedLayoutEngine._prepare_sparse_attention(_engine(False), cfg)  # control: a CPU engine patches nothing


def test_a_cpu_engine_sets_the_models_attention_and_refuses_a_model_without_one():
    from verl_ds4.models.ds4.attention import DS4AttentionSpec, DS4HybridAttention

    spec = DS4AttentionSpec(hidden_size=16, num_heads=2, head_dim=8, rope_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=4,
                            compress_ratio=4, index_n_heads=2, index_head_dim=8, index_topk=2)  # fmt: skip
    model = torch.nn.ModuleDict({"a": DS4HybridAttention(spec), "b": DS4HybridAttention(spec)})
    engine = _engine(False, _config(sparse_attention="linear"))
    _ResolvedLayoutEngine._use_sparse_core(engine, [model])
    assert [m.sparse_core for m in model.values()] == ["linear", "linear"]
    with pytest.raises(ValueError, match="this model has no DS4 / V4.1 sparse attention"):
        _ResolvedLayoutEngine._use_sparse_core(engine, [torch.nn.Linear(2, 2)])
    fresh = torch.nn.ModuleDict({"a": DS4HybridAttention(spec)})
    _ResolvedLayoutEngine._use_sparse_core(_engine(False, _config()), [fresh])  # control: the default leaves it dense
    assert fresh["a"].sparse_core == "dense"


def test_a_bad_value_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"engine sparse_attention='flash': expected one of \['megatron', 'linear'\]"):
        _config(sparse_attention="flash")
