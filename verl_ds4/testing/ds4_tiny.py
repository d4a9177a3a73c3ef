"""A tiny transformers ``DeepseekV4ForCausalLM`` with every DS4 component active, for fidelity tests.

* :func:`tiny_hf_config`: 4 layers (sliding, CSA, HCA, CSA), hc_mult 2, 4 routed experts top-2, one
  shared expert, one hash layer, a SwiGLU clamp the activations exceed, indexer top-2 of many blocks;
* :func:`random_hf_model`: that model in fp64 with every parameter and routing buffer random
  (biases that change the choice, a hash table of distinct experts per token);
* :func:`file_tensors`: its weights under the names ``save_pretrained`` writes (no disk round trip).
"""

from __future__ import annotations

import torch

__all__ = ["tiny_hf_config", "random_hf_model", "file_tensors", "random_sequences"]


def tiny_hf_config(**overrides):
    from transformers import DeepseekV4Config

    values = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        sliding_window=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        swiglu_limit=0.6,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1},
    )
    values.update(overrides)
    cfg = DeepseekV4Config(**values)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return cfg


def random_hf_model(cfg, seed: int = 0):
    """``DeepseekV4ForCausalLM(cfg)`` in fp64, eval mode, all weights and routing buffers random."""
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.models.ds4.hf_reference import fp64_reference

    with fp64_reference():
        model = DeepseekV4ForCausalLM(cfg).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("scale"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() >= 2:
                p.copy_(noise * p.shape[-1] ** -0.5 * (2.0 if "experts" in name else 1.0))
            else:
                p.copy_(0.5 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen, dtype=torch.float64))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))
    return model


def file_tensors(hf_model) -> dict[str, torch.Tensor]:
    """The model's state dict under ``save_pretrained``'s names: ``head.weight``, per-expert w1/w3/w2."""
    out = {}
    for name, t in hf_model.state_dict().items():
        if "rotary_emb" in name or name.endswith("inv_freq"):
            continue
        if name == "lm_head.weight":
            out["head.weight"] = t
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.w1.weight"], out[f"{prefix}{e}.w3.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{prefix}{e}.w2.weight"] = w
        else:
            out[name] = t
    return out


def random_sequences(lengths, vocab: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
