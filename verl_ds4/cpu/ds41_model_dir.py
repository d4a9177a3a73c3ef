"""The CPU jobs' DeepSeek-V4.1 model folder: a tiny V4.1 config with every backbone component on, seeded weights.

* :func:`ds41_tiny_config` - the ``config.json`` dict (flat text config, ``model_type: deepseek_v41``) of
  an 8-layer V4.1 sized to the CPU jobs' character tokenizer: window-only, ratio-2 and ratio-1 layers;
  Full / Reindex / Reuse roles (KV sources 2, 5; index sources 2, 3, 5, 6), a hierarchical candidate
  source (5); Engram on layers 1 and 3 whose normalisation tables come from the folder's
  ``tokenizer.json`` (the character tokenizer: cased letters fold onto one Engram key each);
  single-pass mHC with 2 streams; V4's MoE (4 routed experts, top 2, a shared expert, the SwiGLU clamp).
  **No DSpark drafter**: SFT and RL train the backbone, and verl's ``model.mtp`` is off; a folder that
  has one is refused with ``model.mtp.enable=true`` (:mod:`verl_ds4.cpu.ds41_builder`).
* :func:`write_ds41_weights` - ``model.safetensors`` in our names
  (:func:`verl_ds4.models.ds41.folder.save_folder`) of a seeded init
  (:func:`verl_ds4.models.ds4.model.init_ds4_weights`: norm scales and mHC ``alpha`` 1, biases and
  attention sinks 0, matrices ``N(0, 0.02)``), after the tokenizer is in the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DS41_TINY_SEED", "ds41_tiny_config", "write_ds41_weights"]

#: Seed of the tiny V4.1's weights.
DS41_TINY_SEED = 4141


def ds41_tiny_config(vocab_size: int, tokenizer, **overrides: Any) -> dict[str, Any]:
    """The tiny V4.1's ``config.json`` for ``tokenizer`` (a fast tokenizer of exactly ``vocab_size`` ids; the
    CPU jobs pass :func:`verl_ds4.cpu.sft_data.build_char_tokenizer`'s): its Engram key count, pad / bos / eos ids."""
    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds41.engram import engram_token_map

    if len(tokenizer) != vocab_size:
        # Engram's table covers the tokenizer's ids; sampled ids from padded rows could not be hashed.
        raise ValueError(f"vocab_size={vocab_size}: the tiny V4.1 uses exactly the tokenizer's {len(tokenizer)} ids; "
                         f"pass vocab_size={len(tokenizer)}.")  # fmt: skip
    _, compressed = engram_token_map(tokenizer)
    config: dict[str, Any] = dict(
        model_type=ds41_facts.HF_MODEL_TYPE,
        architectures=["DeepseekV41ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        o_groups=2,
        swiglu_limit=10.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 1024},
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        sliding_window=16,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 3, 5, 6],
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        candidate_source_layer_id=5,
        candidate_topk_blocks=4,
        candidate_block_size=4,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        hc_eps=1e-6,
        engram_layer_ids=[1, 3],
        engram_max_ngram_size=3,
        engram_vocab_size=11,
        engram_n_heads=2,
        engram_head_dim=16,
        engram_pad_token_id=int(tokenizer.pad_token_id),
        engram_compressed_vocab_size=compressed,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.update(overrides)
    if "engram_num_embeddings" not in overrides:
        config["engram_num_embeddings"] = ds41_facts.engram_rows_needed(config)  # exactly the hash buckets
    ds41_facts.read_config(config)
    return config


def write_ds41_weights(folder: str | Path, config: dict, seed: int = DS41_TINY_SEED) -> Path:
    """``folder/model.safetensors`` (and ``config.json``) of a seeded :class:`~verl_ds4.models.ds41.model.DS41Model`;
    the folder's ``tokenizer.json`` (written first) gives the Engram table."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds4.model import init_ds4_weights
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.folder import WEIGHTS, save_folder
    from verl_ds4.models.ds41.model import DS41Model

    folder = Path(folder)
    tokenizer_file = folder / ds41_facts.TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise ValueError(f"{folder} has no {ds41_facts.TOKENIZER_FILE}: write the tokenizer first (Engram hashes its ids).")
    table = engram_token_map(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file)))[0]
    model = DS41Model(config, table, dtype=torch.float32)
    init_ds4_weights(model, seed=seed, std=float(config.get("initializer_range", 0.02)))
    save_folder(model, folder, config)
    return folder / WEIGHTS
