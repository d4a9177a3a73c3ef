"""The DS4 proxy model and the DS4 attention's CP contract (errors, layout declaration)."""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds4.attention import DS4AttentionSpec, DS4HybridAttention
from verl_ds4.models.ds4 import proxy as _proxy  # noqa: F401  (import Megatron once; forked ranks inherit it)
from verl_ds4.mcore.distributed import run_distributed

SPEC = dict(hidden_size=16, num_heads=2, head_dim=8, rope_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=4,
            window_size=8, index_n_heads=2, index_head_dim=8, index_topk=2, yarn_original_max_position_embeddings=64)


def _attention(ratio: int, seed: int = 0) -> DS4HybridAttention:
    torch.manual_seed(seed)
    attn = DS4HybridAttention(DS4AttentionSpec(compress_ratio=ratio, **SPEC), dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn


def test_layout_declaration():
    assert DS4HybridAttention.required_cp_partition_mode == "contiguous"
    assert _attention(0).min_local_rows == 8  # the window
    assert _attention(4).min_local_rows == 8  # max(window, 2 * 4)
    assert _attention(128).min_local_rows == 128  # max(window, 128)


def test_bad_sizes_fail_at_construction():
    with pytest.raises(ValueError, match="o_groups"):
        DS4AttentionSpec(**{**SPEC, "o_groups": 3})
    with pytest.raises(ValueError, match="compression ratio"):
        DS4AttentionSpec(compress_ratio=1, **SPEC)


def test_global_cu_seqlens_required():
    attn = _attention(4)
    x = torch.randn(20, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="global padded cu_seqlens"):
        attn(x, torch.tensor([0, 10, 30]))


def _errors_at_cp2(rank, world):
    import torch.distributed as dist

    attn = _attention(128)
    group = dist.group.WORLD
    found = {}
    x = torch.randn(128, 16, dtype=torch.float64)
    cu = torch.tensor([0, 100, 256])
    try:
        attn(x, cu, cp_group=group, cp_partition_mode="zigzag")
    except ValueError as err:
        found["zigzag"] = str(err)
    small = torch.randn(64, 16, dtype=torch.float64)
    try:
        attn(small, torch.tensor([0, 128]), cp_group=group)
    except RuntimeError as err:
        found["rows"] = str(err)
    return found


def test_cp_errors_are_clear():
    found = run_distributed(_errors_at_cp2, world_size=2)[0]
    assert "contiguous" in found["zigzag"] and "zigzag" in found["zigzag"]
    assert "local_rows=64" in found["rows"] and "D_window=128" in found["rows"] and "min_local_rows=128" in found["rows"]


def _proxy_checks(rank, world):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    from verl_ds4.models.ds4.mcore_attention import DS4HybridSelfAttention
    from verl_ds4.models.ds4.proxy import build_proxy_model

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        model = build_proxy_model(dtype=torch.float64)
        critic = build_proxy_model(dtype=torch.float64, value_head=True)
        assert isinstance(model, GPTModel)
        attns = [layer.self_attention for layer in model.decoder.layers]
        assert all(isinstance(a, DS4HybridSelfAttention) for a in attns)
        ratios = [a.spec.compress_ratio for a in attns]
        assert {0, 4, 128} <= set(ratios)
        assert model.config.min_local_rows == 128
        assert model.config.experimental_attention_variant == "dsv4_hybrid"
        assert all(p.dtype == torch.float64 for p in model.parameters())
        out = {}
        ids = torch.randint(0, 97, (1, 256), generator=torch.Generator().manual_seed(0))
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                              cu_seqlens_kv_padded=cu, max_seqlen_q=156, max_seqlen_kv=156)
        out["logits"] = tuple(model(ids, None, None, packed_seq_params=thd).shape)
        values = critic(ids, None, None, packed_seq_params=thd)
        out["values"] = tuple(values.shape)
        # BSHD at CP=1: each batch column is one sequence, same result as THD with those boundaries.
        two = torch.cat([ids[:, :128], ids[:, 128:]], dim=0)
        even = torch.tensor([0, 128, 256], dtype=torch.int32)
        thd_even = PackedSeqParams(qkv_format="thd", cu_seqlens_q=even, cu_seqlens_kv=even, cu_seqlens_q_padded=even,
                                   cu_seqlens_kv_padded=even, max_seqlen_q=128, max_seqlen_kv=128)
        bshd = model(two, None, None)
        packed = model(ids, None, None, packed_seq_params=thd_even)
        out["bshd_vs_thd"] = (bshd.reshape(1, 256, -1) - packed).abs().max().item()
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_proxy_is_a_real_gpt_model_with_ds4_attention():
    out = run_distributed(_proxy_checks, world_size=1)[0]
    assert out["logits"] == (1, 256, 97)
    assert out["values"] == (1, 256, 1)
    assert out["bshd_vs_thd"] < 1e-12


def _bshd_with_cp(rank, world):
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.proxy import build_proxy_model

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        model = build_proxy_model(dtype=torch.float64)
        try:
            model(torch.zeros(2, 128, dtype=torch.long), None, None)
        except ValueError as err:
            return str(err)
        return None
    finally:
        parallel_state.destroy_model_parallel()


def test_bshd_with_cp_is_rejected():
    message = run_distributed(_bshd_with_cp, world_size=2)[0]
    assert message is not None and "THD" in message and "BSHD" in message


def test_packaged_proxy_config_and_validation(tmp_path):
    from verl_ds4.models.ds4.proxy import load_proxy_config

    cfg = load_proxy_config()
    assert {0, 4, 128} <= set(cfg["compress_ratios"])
    broken = {k: v for k, v in cfg.items() if k != "window_size"}
    with pytest.raises(ValueError, match="window_size"):
        load_proxy_config(broken)
    path = tmp_path / "proxy.json"
    path.write_text(__import__("json").dumps(cfg))
    assert load_proxy_config(path) == cfg
