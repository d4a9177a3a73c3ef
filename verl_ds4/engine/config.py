"""verl-ds4's Megatron engine config: verl's ``McoreEngineConfig`` plus the settings it owns.

``DS4McoreEngineConfig`` adds two fields to verl 0.9.1's config and keeps every other field and
check of verl's. Select it in a Hydra config with ``_target_: verl_ds4.engine.config.
DS4McoreEngineConfig`` (the DS4 recipes do; see ``recipes/recipe/``); engines built from verl's
own config read the defaults below.

* ``indexer_replay`` (default ``false``): the actor replays the rollout's indexer top-k choices
  (:mod:`verl_ds4.mcore.indexer_replay`; DS4 and V4.1 only, refused for a model without an indexer).
* ``cp_balance``: ``null`` (default: sequences stay in batch order in the packed buffer) or the
  name of a per-token cost model (``ds4`` or ``dense``, :mod:`verl_ds4.layout.cost`): with the
  contiguous CP layout, the order of sequences in the buffer is chosen to minimise the most
  loaded CP rank's cost (:mod:`verl_ds4.layout.balance`); outputs come back in batch order. Off
  by default until measured on GPUs. A zigzag layout with ``cp_balance`` set is refused when the
  engine resolves its layout (start-up).
* ``sparse_attention``: ``megatron`` (default: Megatron-LM dev's own unfused DS4 sparse attention,
  whose backward is quadratic in a GPU's packed tokens) or ``linear`` (verl-ds4's row-chunked core,
  :mod:`verl_ds4.kernels.sparse_attention`, memory linear in the tokens, the same numbers; installed
  into Megatron's DS4 layers at start-up by :mod:`verl_ds4.mcore.sparse_attention_patch`, refused with
  ``dsa_kernel_backend=cudnn``, which does not use it). Recipe knob ``ds4.sparse_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.workers.config import McoreEngineConfig

from verl_ds4 import ds4_facts
from verl_ds4.layout.cost import COST_MODELS, DS4CostShape, TokenCostModel, ds4_cost_model

__all__ = ["CP_BALANCE_CHOICES", "SPARSE_ATTENTION_CHOICES", "check_sparse_attention_backend", "refuse_model_without_sparse_attention", "sparse_attention_of", "DS4McoreEngineConfig", "cp_balance_cost_model", "cp_balance_of", "ds4_cost_shape"]

CP_BALANCE_CHOICES = tuple(COST_MODELS)  # the cost models PlanOptions.balance accepts
SPARSE_ATTENTION_CHOICES = ds4_facts.SPARSE_ATTENTION_CHOICES  # who computes the unfused DS4 sparse attention


def _check_sparse_attention(value) -> str:
    if value is None:
        return "megatron"
    if value not in SPARSE_ATTENTION_CHOICES:
        raise ValueError(
            f"engine sparse_attention={value!r}: expected one of {list(SPARSE_ATTENTION_CHOICES)} "
            "(megatron: Megatron-LM dev's unfused core; linear: verl-ds4's memory-linear core; "
            "recipe knob ds4.sparse_attention)."
        )
    return value


def _check_cp_balance(value) -> Optional[str]:
    if value is None:
        return None
    if value not in CP_BALANCE_CHOICES:
        raise ValueError(
            f"engine cp_balance={value!r}: expected null (batch order) or a cost model name, one of "
            f"{list(CP_BALANCE_CHOICES)} (recipe knob ds4.cp_balance)."
        )
    return value


@dataclass
class DS4McoreEngineConfig(McoreEngineConfig):
    """verl's ``McoreEngineConfig`` plus ``cp_balance`` and ``indexer_replay`` (see the module docstring)."""

    cp_balance: Optional[str] = None
    # Rollout indexer replay (verl_ds4.mcore.indexer_replay): the actor's log-prob recompute and update take
    # the rollout's sparse-attention top-k choices (batch field ``indexer_topk``). Off by default; set on the
    # actor only (actor_rollout_ref.actor.megatron.indexer_replay); the reference and critic ignore it.
    indexer_replay: bool = False
    # The unfused DS4 sparse-attention core: Megatron-LM dev's own ("megatron") or verl-ds4's memory-linear
    # one ("linear", verl_ds4.kernels.sparse_attention), installed into Megatron's DS4 layers at start-up.
    sparse_attention: str = "megatron"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_cp_balance(self.cp_balance)
        _check_sparse_attention(self.sparse_attention)


def cp_balance_of(engine_config) -> Optional[str]:
    """The ``cp_balance`` of any engine config (verl's own has none: ``None``), checked."""
    return _check_cp_balance(getattr(engine_config, "cp_balance", None))


def sparse_attention_of(engine_config) -> str:
    """The ``sparse_attention`` of any engine config (verl's own has none: ``"megatron"``), checked."""
    return _check_sparse_attention(getattr(engine_config, "sparse_attention", None))


def check_sparse_attention_backend(engine_config) -> None:
    """``sparse_attention=linear`` replaces the unfused path only: refused with ``dsa_kernel_backend`` other than none."""
    overrides = dict(getattr(engine_config, "override_transformer_config", None) or {})
    backend = str(overrides.get("dsa_kernel_backend") or "none")
    if not ds4_facts.sparse_attention_applies(sparse_attention_of(engine_config), backend):
        raise ValueError(
            f"engine sparse_attention='linear' replaces Megatron-LM dev's unfused DS4 sparse attention, but "
            f"dsa_kernel_backend={backend!r} runs the fused kernels, which do not use it. Set ds4.sparse_attention=megatron "
            "to keep the fused path, or ds4.dsa_kernel_backend=none to train with the linear core."
        )


def refuse_model_without_sparse_attention() -> None:
    """The refusal of ``sparse_attention=linear`` for a CPU model without a DS4 / V4.1 sparse attention."""
    raise ValueError(
        "engine sparse_attention='linear', but this model has no DS4 / V4.1 sparse attention to run it "
        "(no attention module with a sparse_core). Set sparse_attention=megatron (recipe knob ds4.sparse_attention)."
    )


def ds4_cost_shape(hf_config) -> DS4CostShape:
    """The DS4 cost model's shape from a model's own Hugging Face config (DS4-Flash where a
    field is absent): layer ratios with the MTP layers, sizes, window and indexer."""
    flash = DS4CostShape()
    text = getattr(hf_config, "text_config", None) or hf_config

    def get(name, default):
        value = getattr(text, name, None)
        return default if value is None else int(value)

    experts = get("num_experts_per_tok", flash.moe_active_experts - 1) + get("n_shared_experts", 1)
    ratios = ds4_facts.with_mtp(ds4_facts.layer_compress_ratios(text), ds4_facts.mtp_layers(text))
    return DS4CostShape(
        hidden_size=get("hidden_size", flash.hidden_size),
        num_heads=get("num_attention_heads", flash.num_heads),
        head_dim=get("head_dim", flash.head_dim),
        q_lora_rank=get("q_lora_rank", flash.q_lora_rank),
        o_groups=get("o_groups", flash.o_groups),
        o_lora_rank=get("o_lora_rank", flash.o_lora_rank),
        moe_active_experts=experts,
        moe_intermediate_size=get("moe_intermediate_size", flash.moe_intermediate_size),
        window=ds4_facts.window_size(text),
        index_topk=get("index_topk", flash.index_topk),
        index_n_heads=get("index_n_heads", flash.index_n_heads),
        index_head_dim=get("index_head_dim", flash.index_head_dim),
        layer_ratios=ratios,
    )


def cp_balance_cost_model(cp_balance: Optional[str], hf_config) -> "str | TokenCostModel | None":
    """What ``PlanOptions.balance`` gets for ``cp_balance``: for ``ds4`` on a DS4 model, the cost model
    built from the model's own config (so DS4-Pro is balanced with Pro's layers, not Flash's);
    otherwise the name itself (``dense`` needs no shape; without a model config the default shape)."""
    if cp_balance == "ds4" and hf_config is not None and getattr(hf_config, "model_type", None) == ds4_facts.HF_MODEL_TYPE:
        return ds4_cost_model(ds4_cost_shape(hf_config))
    return cp_balance
