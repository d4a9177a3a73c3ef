"""The tiny DeepSeek-V4.1 as a Megatron-Core ``GPTModel``: Megatron's embedding and output layer around
our V4.1 decoder (:mod:`.model`), as V4's :class:`~verl_ds4.models.ds4.model.DS4Model` does for V4.

    config = ds41_transformer_config(text, dtype=torch.float64)          # the V4.1 text config dict
    model = DS41MegatronModel(config, token_map=engram_token_map(tokenizer)[0])
    logits = model(ids, None, None, packed_seq_params=params)           # ids [1, rows] -> [1, rows, vocab]

Megatron's parallel state must be initialised (TP = PP = 1, any CP). Under CP the input is THD with
the contiguous split (``docs/ds4-context-parallel.md`` section 1): ``packed_seq_params`` carries the
global ``cu_seqlens_q_padded``; every rank must hold at least :attr:`DS41TransformerConfig.min_local_rows`
rows. The state dict has our V4.1 names (``embedding.word_embeddings.weight``, ``decoder.layers.<i>.*``,
``decoder.final_layernorm.weight``, ``output_layer.weight``), the same as :class:`~.model.DS41Model`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_ds4 import ds41_facts, ds4_facts

from ..ds4.attention import _RMSNorm
from ..ds4.device import building_on, device_fields, megatron_layers_on
from ..ds4.mcore_attention import cpu_ds4_settings
from ..ds4.proxy import ValueHead
from .engram import EngramHasher
from .model import DS41Layer, run_decoder

__all__ = ["DS41TransformerConfig", "ds41_transformer_config", "DS41TransformerBlock", "DS41MegatronModel"]


@dataclass
class DS41TransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus the V4.1 text config (``ds41_text``), checked by ``ds41_facts`` at construction."""

    cp_partition_mode: str = ds4_facts.CP_PARTITION_MODE
    ds41_text: dict = field(default_factory=dict)
    ds41_cache_qdq: bool = False  # the released cache rounding (models/ds41/cache_qdq.py)

    def __post_init__(self):
        super().__post_init__()
        ds41_facts.read_config({"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": self.ds41_text})
        if self.tensor_model_parallel_size != 1 or self.pipeline_model_parallel_size != 1:
            raise ValueError("The CPU DeepSeek-V4.1 model runs at tensor_model_parallel_size=1 and "
                             "pipeline_model_parallel_size=1 (scale with context or data parallelism).")  # fmt: skip
        problem = ds4_facts.check_cp_partition_mode(self.cp_partition_mode, self.context_parallel_size,
                                                    attention="DeepSeek-V4.1 attention (CSA2) and Engram")
        if problem:
            raise ValueError(problem.engine_message())

    @property
    def min_local_rows(self) -> int:
        return ds41_facts.min_local_rows(self.ds41_text)


def ds41_transformer_config(text: dict, dtype: torch.dtype = torch.float32, cp_size: int | None = None, device=None,
                            **overrides) -> DS41TransformerConfig:
    """The config of a V4.1 text config dict (``config.json``'s ``text_config``); ``device`` (default: the CPU;
    ``"cuda[:N]"``, ``"meta"``) is where a model built from it creates its tensors."""
    from megatron.core import parallel_state

    text = dict(ds41_facts.text_config(text))
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    get = lambda key: ds41_facts.text_value(text, key)  # noqa: E731
    fields = dict(
        num_layers=int(get("num_hidden_layers")),
        hidden_size=int(get("hidden_size")),
        ffn_hidden_size=int(get("moe_intermediate_size")),
        num_attention_heads=int(get("num_attention_heads")),
        kv_channels=int(get("head_dim")),
        layernorm_epsilon=float(get("rms_norm_eps")),
        **cpu_ds4_settings(dtype, cp_size),
        # Every V4.1 layer is an MoE layer (V4's DS4MoE, score routers): Megatron's MoE fields, which verl's
        # router replay reads (moe_router_topk: the routes' width; the MoE layer count from moe_layer_freq).
        num_moe_experts=int(get("n_routed_experts")),
        moe_ffn_hidden_size=int(get("moe_intermediate_size")),
        moe_router_topk=int(get("num_experts_per_tok")),
        moe_shared_expert_intermediate_size=int(get("moe_intermediate_size")) * int(get("n_shared_experts") or 1),
        moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        ds41_text=text,
    )
    # ``device`` names where the model's tensors are created (models/ds4/device.py); an override contradicting it is refused.
    return DS41TransformerConfig(**{**fields, **device_fields(device, overrides)})


class DS41TransformerBlock(MegatronModule):
    """``model.decoder``: the V4.1 layers, the Engram hasher and the final norm (pipeline size 1)."""

    def __init__(self, config: DS41TransformerConfig, token_map: list[int] | None = None):
        super().__init__(config=config)
        text, dtype = config.ds41_text, config.params_dtype
        self.facts = ds41_facts.read_config({"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": text})
        if self.facts.engram_layers and token_map is None:
            raise ValueError(f"Engram layers {list(self.facts.engram_layers)} need the tokenizer-normalisation table: "
                             "pass token_map=engram_token_map(tokenizer)[0] with the checkpoint's tokenizer.")  # fmt: skip
        with building_on(config):  # the config's device (models/ds4/device.py)
            self.engram_hasher = EngramHasher(text, token_map) if self.facts.engram_layers else None
            self.layers = torch.nn.ModuleList(
                DS41Layer(text, i, dtype=dtype, cache_qdq=config.ds41_cache_qdq) for i in range(self.facts.num_layers)
            )
            self.final_layernorm = _RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype=dtype)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor

    @classmethod
    def check_cp_partition(cls, cp_partition_mode: str | None, cp_size: int) -> None:
        """Refuse rows of any CP split but the contiguous one (the config refuses a zigzag setting; this
        refuses a batch packed with another plan, which would otherwise run with wrong positions,
        CSA2 blocks and Engram n-grams)."""
        if cp_size > 1 and cp_partition_mode != ds4_facts.CP_PARTITION_MODE:
            raise ValueError(
                f"DeepSeek-V4.1 under CP reads a contiguous split, got packed_seq_params.cp_partition_mode="
                f"{cp_partition_mode!r} at CP={cp_size}: CSA2 and Engram locate rows as cp_rank * local_rows + i "
                "and take the previous rank's last rows by the left halo (a zigzag rank holds two chunks of every "
                "sequence). Pack the batch with the contiguous layout (verl_ds4.mcore.thd.make_plan(layout="
                "'contiguous')), which records cp_partition_mode='contiguous'."
            )

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, hash_token_ids=None, inference_context=None, **unused):
        """``hidden_states`` ``[s, 1, h]`` (THD rows), ``hash_token_ids`` ``[s, 1]`` (the rows' token ids,
        for Engram) -> ``[s, 1, h]`` normed rows."""
        from megatron.core import parallel_state

        if inference_context is not None:
            raise NotImplementedError("The CPU DeepSeek-V4.1 model scores and trains only (no inference context).")
        if hidden_states.shape[1] != 1:
            raise ValueError(f"DeepSeek-V4.1 takes packed THD rows [s, 1, h], got {tuple(hidden_states.shape)}.")
        if self.engram_hasher is not None and hash_token_ids is None:
            raise ValueError("Engram layers need the token id of every row: pass hash_token_ids [s, 1] (DS41MegatronModel does).")
        cp_size = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        cp_group = parallel_state.get_context_parallel_group() if cp_size > 1 else None
        if packed_seq_params is not None:
            self.check_cp_partition(getattr(packed_seq_params, "cp_partition_mode", None), cp_size)
        cu = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q_padded
        ids = None if hash_token_ids is None else hash_token_ids[:, 0]
        if ids is None:
            ids = torch.zeros(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
        hidden = run_decoder(self.layers, self.engram_hasher, self.facts, hidden_states[:, 0], ids, cu, cp_group)
        return self.final_layernorm(hidden).unsqueeze(1)


class DS41MegatronModel(GPTModel):
    """A ``GPTModel`` with the V4.1 decoder; ``value_head=True``: a hidden -> 1 critic head instead of the LM head."""

    def __init__(self, config: DS41TransformerConfig, token_map: list[int] | None = None, vocab_size: int | None = None,
                 max_sequence_length: int = 1 << 20, pg_collection=None, value_head: bool = False):  # fmt: skip
        if not isinstance(config, DS41TransformerConfig):
            raise TypeError(f"DS41MegatronModel needs a DS41TransformerConfig, got {type(config).__name__}.")
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        with megatron_layers_on(config):  # every tensor on the config's device (models/ds4/device.py)
            super().__init__(
                config=config,
                transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[], layer_norm=WrappedTorchNorm),
                vocab_size=int(vocab_size or ds41_facts.text_value(config.ds41_text, "vocab_size")),
                max_sequence_length=max_sequence_length,
                parallel_output=True,
                share_embeddings_and_output_weights=False,
                position_embedding_type="none",
                pg_collection=pg_collection,
            )
        with building_on(config):
            self.decoder = DS41TransformerBlock(config, token_map)
            if value_head:  # verl's critic: hidden -> 1 in place of the LM head (V4's ValueHead)
                self.output_layer = ValueHead(config.hidden_size, config.params_dtype)
        for param in self.parameters():  # Megatron's torch fallbacks ignore params_dtype
            param.data = param.data.to(config.params_dtype)

    def forward(self, input_ids, position_ids, attention_mask, *args, hash_token_ids: torch.Tensor | None = None, **kwargs: Any):
        """GPTModel's forward; ``input_ids`` ``[1, s]`` also feed Engram (``hash_token_ids`` overrides them)."""
        ids = hash_token_ids if hash_token_ids is not None else input_ids
        block_kwargs = dict(kwargs.pop("extra_block_kwargs", None) or {})
        if ids is not None:
            block_kwargs["hash_token_ids"] = ids.transpose(0, 1)
        return super().forward(input_ids, position_ids, attention_mask, *args, extra_block_kwargs=block_kwargs, **kwargs)
