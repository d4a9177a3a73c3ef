"""The architecture numbers of one DeepSeek-V4.1 checkpoint, as the GPU recipes and their validator read them.

The V4.1 sibling of :mod:`verl_ds4.models.ds4.provider`: :class:`DS41ModelFacts` has the attributes the
recipe validator, the printed plan and the memory check read from :class:`~verl_ds4.models.ds4.provider.
DS4ModelFacts` (``name``, ``num_layers``, ``n_routed_experts``, ``min_local_rows``, ``sizes``, ...), plus
what V4.1 adds: the layer roles, the Engram layers and the DSpark stages. Every rule of
:mod:`verl_ds4.ds41_facts` is applied to the numbers (``violations``: each one field, why and the fix),
from the checkpoint's ``config.json`` (with the folder's file names, so a missing ``tokenizer.json`` for
Engram is found) when the model path is a local folder, else from the recipe's ``ds4.model`` block
(``configs/ds4_model/v41_flash.yaml``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from verl_ds4 import ds41_facts
from verl_ds4.ds4_facts import Violation
from verl_ds4.models.ds4.provider import local_config_json
from verl_ds4.models.ds4.sizes import MissingSizeField

from .sizes import DS41Sizes

__all__ = ["DS41ModelFacts", "is_v41_block", "load_ds41_model_facts"]

#: Keys of a ``ds4.model`` block that are not ``config.json`` keys.
_BLOCK_ONLY = ("name", "hf_model_type")


def is_v41_block(block: Mapping[str, Any] | None) -> bool:
    """Whether a recipe's ``ds4.model`` block describes a V4.1 model (``hf_model_type: deepseek_v41``)."""
    return bool(block) and block.get("hf_model_type") == ds41_facts.HF_MODEL_TYPE


@dataclass(frozen=True)
class DS41ModelFacts:
    """Architecture numbers of one V4.1 checkpoint (backbone layers; the DSpark stages counted apart)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    csa_window_size: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    min_local_rows: int
    source: str
    engram_layers: tuple[int, ...] = ()
    dspark_stages: int = 0
    sizes: DS41Sizes | None = None
    sizes_missing: str | None = None
    #: every V4.1 rule the config breaks (:func:`verl_ds4.ds41_facts.config_violations`)
    violations: tuple[Violation, ...] = field(default_factory=tuple)
    #: V4.1 has no MTP layer: its ``mtp.*`` stages are a DSpark drafter, which these recipes do not train
    mtp_layers: int = 0
    family: str = "ds41"
    #: the longest position the model is built for (``max_position_embeddings``); None: unknown
    max_position_embeddings: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str, name: str, tokenizer_files: list[str] | None = None,
                    fallback: Mapping[str, Any] | None = None) -> "DS41ModelFacts":
        """From a V4.1 ``config.json`` dict (nested or flat); keys it lacks come from ``fallback``."""
        text = dict(ds41_facts.text_config(config))
        for key, value in (fallback or {}).items():
            text.setdefault(key, value)
        model_type = config.get("model_type", text.get("model_type"))
        violations = ds41_facts.config_violations({**text, "model_type": model_type}, tokenizer_files)
        n = int(text.get("num_hidden_layers") or 0)
        ratios = tuple(int(r) for r in (text.get("compress_ratios") or ())[:n])
        try:
            rows = ds41_facts.min_local_rows(text) if n and len(ratios) == n else int(ds41_facts.text_value(text, "sliding_window"))
        except (TypeError, ValueError):
            rows = int(ds41_facts.TEXT_DEFAULTS["sliding_window"])
        sizes, missing = None, None
        if violations:
            missing = "the V4.1 config breaks the rules listed as errors"
        else:
            try:
                sizes = DS41Sizes.from_hf_config(text, source)
            except MissingSizeField as e:
                missing = str(e)
        roles = None if violations else ds41_facts.read_config({**text, "model_type": model_type})
        return cls(
            name=str(text.get("_name_or_path") or name),
            model_type=str(model_type),
            num_layers=n,
            hidden_size=int(text.get("hidden_size") or 0),
            num_attention_heads=int(text.get("num_attention_heads") or 0),
            n_routed_experts=int(text.get("n_routed_experts") or 1),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            csa_window_size=int(ds41_facts.text_value(text, "sliding_window")),
            index_topk=int(text.get("index_topk") or 0),
            compress_ratios=ratios,
            min_local_rows=rows,
            source=source,
            engram_layers=roles.engram_layers if roles else (),
            dspark_stages=roles.dspark_stages if roles else 0,
            sizes=sizes,
            sizes_missing=missing,
            violations=tuple(violations),
            max_position_embeddings=int(text["max_position_embeddings"]) if text.get("max_position_embeddings") else None,
        )


def _block_config(block: Mapping[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in block.items() if k not in _BLOCK_ONLY}, "model_type": ds41_facts.HF_TEXT_MODEL_TYPE}


def load_ds41_model_facts(model_path: str | None, recipe_block: Mapping[str, Any], recipe_source: str) -> DS41ModelFacts:
    """Facts for the V4.1 model at ``model_path``: its ``config.json`` (and folder) if local, else the recipe block.

    A local folder's ``config.json`` is checked as it is (a V4 folder breaks ``model_type``); the recipe
    block fills only keys a V4.1 config lacks. Raises ``ValueError`` when ``config.json`` is not JSON.
    """
    block = dict(recipe_block)
    name = str(block.get("name", "DeepSeek-V4.1"))
    config_json = local_config_json(model_path)
    if config_json is None:
        return DS41ModelFacts.from_config(_block_config(block), recipe_source, name)
    try:
        with open(config_json, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read the model config {config_json}: {e}. Fix the file or point the path elsewhere.") from e
    files = sorted(os.listdir(os.path.dirname(config_json)))
    fallback = None if ds41_facts.check_model_type(config, "ds41") else _block_config(block)
    return DS41ModelFacts.from_config(config, config_json, name, tokenizer_files=files, fallback=fallback)
