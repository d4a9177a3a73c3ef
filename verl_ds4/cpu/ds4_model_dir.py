"""The CPU jobs' DeepSeek-V4: a tiny ``DeepseekV4Config`` and a real DS4 checkpoint folder for it.

* :func:`ds4_tiny_hf_config` - the tiny DS4 the CPU main job, the CPU PPO run and the critic
  train: every DS4 component active (sliding / CSA / HCA attention with the DS4 ratios 4 and 128,
  YaRN on the compressed layers, mHC with 4 streams (6 Sinkhorn iterations; DS4 uses 20), 4 routed experts
  top-2 plus one shared expert, a hash-routed first layer, the SwiGLU clamp 10), only the sizes
  shrunk. MTP is off (``num_nextn_predict_layers=0``).
* :func:`write_ds4_weights` - ``model.safetensors`` of that config, written by
  :func:`verl_ds4.models.ds4.hf_checkpoint.save_hf_checkpoint` (transformers' names) from a seeded
  init of :class:`verl_ds4.models.ds4.model.DS4Model` plus a seeded hash table (distinct experts
  per token). ``transformers.DeepseekV4ForCausalLM.from_pretrained(folder)`` loads the folder, and
  the CPU engine's ``deepseek_v4`` builder (:mod:`verl_ds4.cpu.ds4_builder`) starts from it.

The model is built in a one-rank gloo child process (DS4 attention reads Megatron's parallel
state), so the caller's process keeps no process group.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DS4_TINY_SEED", "ds4_tiny_hf_config", "hash_table", "write_ds4_weights"]

#: Seed of the tiny DS4's initial weights and hash table.
DS4_TINY_SEED = 1234

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"]


def ds4_tiny_hf_config(vocab_size: int, **overrides):
    """The tiny DS4 of the CPU jobs as a transformers ``DeepseekV4Config`` (``overrides`` win)."""
    from transformers import DeepseekV4Config

    values = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        sliding_window=32,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        layer_types=list(LAYER_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=24,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        hc_mult=4,
        hc_sinkhorn_iters=6,  # DS4: 20; each iteration is a few tiny ops per mHC call, the CPU job's largest cost
        hc_eps=1e-6,
        swiglu_limit=10.0,
        num_nextn_predict_layers=0,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
        architectures=["DeepseekV4ForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return DeepseekV4Config(**values)


def hash_table(vocab_size: int, num_experts: int, top_k: int, seed: int):
    """``[vocab, top_k]`` int64: for every token ``top_k`` distinct experts (a seeded permutation each)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(vocab_size)])


def _build_and_save(rank: int, world: int, config: dict, folder: str, seed: int, family: str = "transformers") -> str:
    import torch
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.hf_checkpoint import save_hf_checkpoint
    from verl_ds4.models.ds4.model import build_ds4_model

    parallel_state.initialize_model_parallel()
    try:
        model = build_ds4_model(config, dtype=torch.float32, seed=seed)
        tables = hash_table(config["vocab_size"], config["n_routed_experts"], config["num_experts_per_tok"], seed + 1)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("tid2eid"):
                    buf.copy_(tables)
        save_hf_checkpoint(model, folder, family=family)
        return folder
    finally:
        parallel_state.destroy_model_parallel()


def write_ds4_weights(folder: str | Path, hf_config, seed: int = DS4_TINY_SEED, timeout: float = 300.0,
                      family: str = "transformers") -> Path:
    """Write ``folder/model.safetensors`` for ``hf_config`` (a seeded :class:`DS4Model` init) under the tensor names of
    ``family`` (``"transformers"``, or DeepSeek's ``"native"`` ones, which Megatron-Bridge reads); returns the path."""
    from verl_ds4.mcore.distributed import run_distributed

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    run_distributed(_build_and_save, world_size=1, args=(config, str(folder), seed, family), timeout=timeout)
    return folder / "model.safetensors"
