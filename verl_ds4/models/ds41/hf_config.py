"""A Hugging Face config class for ``model_type: deepseek_v41``, so verl's ``AutoConfig`` reads a V4.1 folder.

transformers 5.10.4 (the newest verl 0.9.1 admits) has no ``deepseek_v41``; verl's ``HFModelConfig``
calls ``AutoConfig.from_pretrained(model.path)`` after importing ``model.external_lib``.
:func:`register_auto_config` registers :class:`DeepseekV41Config` (it keeps every ``config.json`` key
as an attribute, nested ``text_config`` included) and leaves a ``deepseek_v41`` that transformers
already knows alone. The model is built from the folder's own ``config.json``
(:func:`verl_ds4.models.ds41.folder.read_folder_config`: every ``ds41_facts`` rule), not from this
object (its ``to_dict`` drops ``rope_scaling``, which transformers renames).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from verl_ds4 import ds41_facts

__all__ = ["DeepseekV41Config", "register_auto_config"]


class DeepseekV41Config(PretrainedConfig):
    """Every key of a V4.1 ``config.json`` as an attribute (flat text config, or nested ``text_config``)."""

    model_type = ds41_facts.HF_MODEL_TYPE

    def __init__(self, text_config: dict | None = None, **kwargs: Any):
        # PretrainedConfig's own fields go to it; the V4.1 keys are kept as written (transformers'
        # RoPE standardisation would rewrite rope_scaling, which V4.1 reads as it is).
        own = {f.name for f in dataclasses.fields(PretrainedConfig)} if dataclasses.is_dataclass(PretrainedConfig) else set()
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k not in own and not k.startswith("_")}
        super().__init__(**kwargs)
        if text_config is not None:
            mine["text_config"] = dict(text_config)
        for key, value in mine.items():
            setattr(self, key, value)

    def __getattr__(self, key: str):  # vocab_size etc. of a nested text_config, for verl's readers
        if key not in ("text_config", "__dict__") and not key.startswith("_"):
            text = self.__dict__.get("text_config")
            if isinstance(text, dict) and key in text:
                return text[key]
        raise AttributeError(key)


def register_auto_config() -> bool:
    """Register :class:`DeepseekV41Config` for ``deepseek_v41`` with ``AutoConfig``; False if one is there."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if ds41_facts.HF_MODEL_TYPE in CONFIG_MAPPING:
        return False
    AutoConfig.register(ds41_facts.HF_MODEL_TYPE, DeepseekV41Config)
    return True
