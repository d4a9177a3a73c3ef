"""DS4HybridAttention reproduces transformers' DeepseekV4Attention (same weights, CP=1, fp64).

Named inherent differences (see verl_ds4/models/ds4/hf_reference.py): transformers computes norms,
RoPE, compressor softmax and indexer scores in float32, so the reference runs under
PromoteFloat32ToFloat64; top-k ties are compared only where the top-k set is unique.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)

from verl_ds4.models.ds4.attention import DS4HybridAttention  # noqa: E402
from verl_ds4.models.ds4.hf_mapping import ds4_to_hf_state_dict, hf_to_ds4_state_dict, spec_from_hf_config  # noqa: E402
from verl_ds4.models.ds4.hf_reference import (  # noqa: E402
    PromoteFloat32ToFloat64,
    hf_attention_forward,
    hf_indexer_scores,
    unambiguous_topk_queries,
)

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
# Ragged lengths: shorter than the window, several windows, not multiples of 4, spanning HCA blocks.
LENGTHS = [5, 13, 40, 131, 300]


def tiny_config(hca_rate: int = 128, index_topk: int = 4, index_n_heads: int = 2) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=64,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=12,
        sliding_window=16,
        index_n_heads=index_n_heads,
        index_head_dim=16,
        index_topk=index_topk,
        layer_types=LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate},
        rope_theta=10000.0,
        compress_rope_theta=40000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=4096,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        attn_implementation="eager",
    )
    cfg._attn_implementation = "eager"
    return cfg


@contextlib.contextmanager
def fp64_reference():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with PromoteFloat32ToFloat64():
            yield
    finally:
        torch.set_default_dtype(previous)


def build_pair(cfg, layer_idx: int, seed: int = 0, promote: bool = True):
    torch.manual_seed(seed)
    ctx = fp64_reference() if promote else contextlib.nullcontext()
    with ctx:
        hf_attn = DeepseekV4Attention(cfg, layer_idx).double().eval()
        rotary = DeepseekV4RotaryEmbedding(cfg).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf_attn.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ours = DS4HybridAttention(spec_from_hf_config(cfg, layer_idx), dtype=torch.float64)
    missing, unexpected = ours.load_state_dict(hf_to_ds4_state_dict(hf_attn.state_dict()), strict=False)
    assert not unexpected and missing == [], (missing, unexpected)
    return hf_attn, rotary, ours


def run_ours(ours, xs):
    lengths = torch.tensor([x.shape[0] for x in xs])
    cu = torch.zeros(len(xs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    out = ours(torch.cat(xs), cu)
    return list(torch.split(out, lengths.tolist()))


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def inputs(cfg, lengths, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64) for n in lengths]


@pytest.mark.parametrize("layer_idx", [0, 1, 2], ids=LAYER_TYPES)
def test_matches_transformers_fp64(layer_idx):
    # index_topk larger than any visible block count: every CSA query has a unique selection.
    cfg = tiny_config(index_topk=1024)
    hf_attn, rotary, ours = build_pair(cfg, layer_idx)
    xs = inputs(cfg, LENGTHS)
    ours_out = run_ours(ours, xs)
    with fp64_reference():
        for x, got in zip(xs, ours_out):
            ref = hf_attention_forward(hf_attn, rotary, x)
            assert rel_diff(got, ref) <= 1e-10, (LAYER_TYPES[layer_idx], x.shape[0], rel_diff(got, ref))


def test_hca_small_ratio_matches_transformers():
    # A ratio-16 HCA layer sees many blocks in short sequences (ratio 128 sees at most 2 above).
    cfg = tiny_config(hca_rate=16)
    hf_attn, rotary, ours = build_pair(cfg, 2, seed=3)
    xs = inputs(cfg, LENGTHS)
    with fp64_reference():
        for x, got in zip(xs, run_ours(ours, xs)):
            assert rel_diff(got, hf_attention_forward(hf_attn, rotary, x)) <= 1e-10


def test_csa_topk_selection_matches_where_unique():
    """k=3 of up to 75 visible blocks: the indexer really selects. Compare every query whose top-k set
    is unique; ties at the k-th place (torch.topk order unspecified) are the named difference."""
    cfg = tiny_config(index_topk=3, index_n_heads=2)
    hf_attn, rotary, ours = build_pair(cfg, 1, seed=5)
    xs = inputs(cfg, [300, 64], seed=11)
    ours_out = run_ours(ours, xs)
    compared = 0
    with fp64_reference():
        for x, got in zip(xs, ours_out):
            ref = hf_attention_forward(hf_attn, rotary, x)
            unique = unambiguous_topk_queries(hf_indexer_scores(hf_attn, x), cfg.index_topk)
            assert unique.float().mean() > 0.5
            compared += int(unique.sum())
            assert rel_diff(got[unique], ref[unique]) <= 1e-10
    # The selection matters: with dense selection the output changes.
    dense = tiny_config(index_topk=1024)
    _, _, ours_dense = build_pair(dense, 1, seed=5)
    assert rel_diff(run_ours(ours_dense, xs)[0], ours_out[0]) > 1e-3
    assert compared > 250  # of 364 queries


def test_fp32_internals_of_transformers_are_the_named_difference():
    """Without the promotion mode the fp64 reference is only fp32-accurate: the gap is real and small."""
    cfg = tiny_config(index_topk=1024)
    hf_attn, rotary, ours = build_pair(cfg, 2, promote=False)
    x = inputs(cfg, [131])[0]
    diff = rel_diff(run_ours(ours, [x])[0], hf_attention_forward(hf_attn, rotary, x))
    assert 1e-12 < diff < 1e-4


def test_weight_mapping_round_trip():
    cfg = tiny_config()
    hf_attn, _, ours = build_pair(cfg, 1)
    back = ds4_to_hf_state_dict(ours.state_dict())
    hf_params = {k: v for k, v in hf_attn.state_dict().items() if "rotary_emb" not in k}
    assert set(back) == set(hf_params)
    for k, v in hf_params.items():
        assert torch.equal(back[k], v), k


def test_packing_does_not_leak_between_sequences():
    cfg = tiny_config(index_topk=1024)
    _, _, ours = build_pair(cfg, 1)
    xs = inputs(cfg, [40, 131])
    together = run_ours(ours, xs)
    alone = run_ours(ours, [xs[1]])[0]
    assert rel_diff(together[1], alone) <= 1e-12
