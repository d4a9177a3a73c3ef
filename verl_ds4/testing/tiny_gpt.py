"""A tiny real Megatron-Core ``GPTModel`` that runs forward on CPU, for layout and engine tests.

Megatron's local ``DotProductAttention`` calls CUDA, so tests swap each layer's ``core_attention``
for :class:`PerTokenAttention`, a pure-PyTorch module in which every row attends to itself only
(output = value). The model is then per-token: each row's output depends only on its token id,
so results of any CP layout can be compared row by row with a CP=1 run. The module declares the
CP partition-mode protocol of :mod:`verl_ds4.mcore.requirements` and records the local rows it was given.
"""

from __future__ import annotations

import torch


class PerTokenAttention(torch.nn.Module):
    """Pure-PyTorch THD core attention for CPU tests: each row sees only itself (``output = value``)."""

    def __init__(self, layout: str = "contiguous", min_local_rows: int | None = None, accepts=()):
        super().__init__()
        # The CP partition-mode protocol (verl_ds4.mcore.requirements), per instance: tests vary it.
        self.required_cp_partition_mode = layout
        self.min_local_rows = min_local_rows
        self.accepted_cp_partition_modes = tuple(accepts)
        self.rows_seen: list[int] = []

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):  # fmt: skip
        self.rows_seen.append(int(value.shape[0]))
        return value.reshape(value.shape[0], -1)


class TinyValueHead(torch.nn.Module):
    """A value head in the place of ``GPTModel.output_layer``: hidden -> one float per row."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return self.linear(hidden_states).float(), None


def build_tiny_gpt(
    *,
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_heads: int = 4,
    num_layers: int = 2,
    seed: int = 0,
    attention=None,
    value_head: bool = False,
    **config_overrides,
):
    """Build a float32 ``GPTModel`` on CPU (Megatron parallel state must be initialised).

    ``attention``: ``None`` keeps Megatron's ``DotProductAttention`` (fine for building, not for
    forward on CPU), or a callable ``layer_index -> nn.Module`` that replaces ``core_attention``.
    The same ``seed`` gives the same weights on every rank.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **config_overrides,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=8192,
        position_embedding_type="none",
    )
    if attention is not None:
        for index, layer in enumerate(model.decoder.layers):
            layer.self_attention.core_attention = attention(index)
    if value_head:
        model.output_layer = TinyValueHead(hidden_size)
    return model
