"""The architecture numbers of one DS4 checkpoint, as recipes and their validator read them.

verl builds DS4 through Megatron-Bridge (``use_mbridge=True``, ``vanilla_mbridge=False``): the bridge
maps HF ``DeepseekV4ForCausalLM`` (``model_type="deepseek_v4"``) onto its provider, and verl applies
the engine config plus ``override_transformer_config`` on top. The rules that provider imposes
(TP=1, contiguous CP, the packing schedulers, the rows per CP rank) are written once, in
:mod:`verl_ds4.ds4_facts`, for the validator and the engine alike.

:class:`DS4ModelFacts` carries the numbers the validator needs. They come from the checkpoint's
``config.json`` when it is readable and from the recipe's ``ds4.model`` block
(``configs/ds4_model/*.yaml``, sources cited there) otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from verl_ds4 import ds4_facts, ds41_facts

from .sizes import DS4Sizes, MissingSizeField

# URI schemes a trainer resolves itself (verl copies them to local disk); not checked on disk.
REMOTE_PATH_SCHEMES = ("hdfs://", "s3://", "gs://", "oss://", "abfs://", "az://", "http://", "https://")


@dataclass(frozen=True)
class DS4ModelFacts:
    """Architecture numbers of one DS4 checkpoint.

    Attributes:
        name: human-readable model name.
        model_type: HF ``model_type`` (``"deepseek_v4"`` for DS4).
        num_layers: decoder layers, MTP excluded.
        mtp_layers: multi-token-prediction layers (``num_nextn_predict_layers``).
        hidden_size: model width.
        num_attention_heads: attention heads.
        n_routed_experts: routed experts per MoE layer (EP must divide it).
        num_experts_per_tok: routed top-k.
        csa_window_size: the sliding window of every layer.
        index_topk: compressed blocks a CSA query selects.
        compress_ratios: per decoder layer (MTP excluded): 0 window only, 4 CSA, 128 HCA.
        source: where these numbers were read from.
        max_position_embeddings: the longest sequence the checkpoint's positions cover (recipes refuse longer).
        sizes: the numbers the parameter count and the memory model need (:class:`~.sizes.DS4Sizes`),
            or ``None`` when the source lacks one (``sizes_missing`` then says which).
    """

    name: str
    model_type: str
    num_layers: int
    mtp_layers: int
    hidden_size: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    csa_window_size: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    source: str
    sizes: DS4Sizes | None = None
    sizes_missing: str | None = None
    #: the longest position the model is built for (config.json's ``max_position_embeddings``); None: unknown
    max_position_embeddings: int | None = None

    def __post_init__(self):
        ds4_facts.check_compress_ratios(self.compress_ratios, self.num_layers)

    @property
    def min_local_rows(self) -> int:
        """Rows every CP rank must hold (:func:`verl_ds4.ds4_facts.min_local_rows`, MTP layers included)."""
        ratios = ds4_facts.with_mtp(self.compress_ratios, self.mtp_layers)
        return ds4_facts.min_local_rows(self.csa_window_size, ratios)

    @classmethod
    def from_recipe_block(cls, block: Mapping[str, Any], source: str) -> "DS4ModelFacts":
        """Build from a recipe's ``ds4.model`` block (``configs/ds4_model/<size>.yaml``)."""
        return cls(
            name=str(block["name"]),
            model_type=str(block.get("hf_model_type", ds4_facts.HF_MODEL_TYPE)),
            num_layers=int(block["num_layers"]),
            mtp_layers=int(block.get("mtp_layers", 0)),
            hidden_size=int(block["hidden_size"]),
            num_attention_heads=int(block["num_attention_heads"]),
            n_routed_experts=int(block["n_routed_experts"]),
            num_experts_per_tok=int(block["num_experts_per_tok"]),
            csa_window_size=int(block["csa_window_size"]),
            index_topk=int(block["index_topk"]),
            compress_ratios=tuple(int(r) for r in block["compress_ratios"]),
            source=source,
            max_position_embeddings=_positions(block.get("max_position_embeddings")),
            **_sizes({}, source, block),
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str, fallback: "DS4ModelFacts") -> "DS4ModelFacts":
        """Build from a checkpoint ``config.json`` dict; fields it lacks come from ``fallback``."""
        text = config.get("text_config") or config
        if ds41_facts.check_model_type(config, "ds4") is not None:
            # A V4.1 folder: its layers are not V4's; keep the recipe's numbers and its model_type,
            # which the recipe validator refuses with the fix (ds41_facts.check_model_type).
            return dataclasses.replace(fallback, model_type=str(config.get("model_type")), source=source)
        window = text.get("csa_window_size", text.get("sliding_window", fallback.csa_window_size))
        # the layer kinds as transformers reads them (its default pattern when the file names none)
        ratios = ds4_facts.layer_compress_ratios(text) if "num_hidden_layers" in text else fallback.compress_ratios
        return cls(
            name=str(text.get("_name_or_path") or fallback.name),
            model_type=str(config.get("model_type", fallback.model_type)),
            num_layers=int(text.get("num_hidden_layers", fallback.num_layers)),
            mtp_layers=int(text.get("num_nextn_predict_layers", fallback.mtp_layers) or 0),
            hidden_size=int(text.get("hidden_size", fallback.hidden_size)),
            num_attention_heads=int(text.get("num_attention_heads", fallback.num_attention_heads)),
            n_routed_experts=int(text.get("n_routed_experts", fallback.n_routed_experts)),
            num_experts_per_tok=int(text.get("num_experts_per_tok", fallback.num_experts_per_tok)),
            csa_window_size=int(window),
            index_topk=int(text.get("index_topk", fallback.index_topk)),
            compress_ratios=ratios,
            source=source,
            max_position_embeddings=_positions(text.get("max_position_embeddings", fallback.max_position_embeddings)),
            **_sizes(config, source, _sizes_fallback(fallback)),
        )


def _positions(value: Any) -> int | None:
    """``max_position_embeddings`` as an int, None when absent."""
    return None if value is None else int(value)


def _sizes(config: Mapping[str, Any], source: str, fallback: Mapping[str, Any]) -> dict[str, Any]:
    """``sizes`` / ``sizes_missing`` keyword arguments for :class:`DS4ModelFacts`."""
    try:
        return {"sizes": DS4Sizes.from_hf_config(config, source, fallback=fallback)}
    except MissingSizeField as e:
        return {"sizes": None, "sizes_missing": str(e)}


def _sizes_fallback(facts: DS4ModelFacts) -> dict[str, Any]:
    """The recipe block's sizes as a fallback mapping (config.json keys win over it)."""
    if facts.sizes is None:
        return {"compress_ratios": facts.compress_ratios, "mtp_layers": facts.mtp_layers}
    import dataclasses

    return dataclasses.asdict(facts.sizes)


def is_remote_path(path: str) -> bool:
    """Whether ``path`` is a URI the trainer downloads itself (not checked on local disk)."""
    return str(path).startswith(REMOTE_PATH_SCHEMES)


def local_config_json(model_path: str | None) -> str | None:
    """Path of ``config.json`` inside a local model folder, or None when there is none."""
    if not model_path or is_remote_path(model_path):
        return None
    candidate = os.path.join(os.path.expanduser(str(model_path)), "config.json")
    return candidate if os.path.isfile(candidate) else None


def load_model_facts(model_path: str | None, recipe_block: Mapping[str, Any], recipe_source: str) -> DS4ModelFacts:
    """Facts for the model at ``model_path``: its ``config.json`` if readable, else the recipe block.

    Raises:
        ValueError: when ``config.json`` exists but is not valid JSON.
    """
    fallback = DS4ModelFacts.from_recipe_block(recipe_block, recipe_source)
    config_json = local_config_json(model_path)
    if config_json is None:
        return fallback
    try:
        with open(config_json, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read the model config {config_json}: {e}. Fix the file or point the path elsewhere.") from e
    return DS4ModelFacts.from_hf_config(config, source=config_json, fallback=fallback)


def pipeline_stage_layers(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage for an even split (earlier stages take the remainder).

    This is the split Megatron-Bridge's ``set_deepseek_v4_pipeline_model_parallel_layout`` builds
    (embedding on the first stage, MTP and loss on the last one).
    """
    if pp <= 0:
        raise ValueError(f"pipeline size must be positive, got {pp}")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if rank < extra else 0) for rank in range(pp)]
