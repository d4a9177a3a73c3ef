"""``sparse_attention=linear`` at engine start-up (the engine config field, :mod:`verl_ds4.engine.config`).

Two steps, both before a training step runs:

* :func:`prepare`: before the model is built. Refused with the fused kernels (they never call the core it
  replaces); on GPU engines, verl-ds4's memory-linear core goes into Megatron-LM dev's DS4 layers
  (:mod:`verl_ds4.mcore.sparse_attention_patch`, which first checks that Megatron is the one it was proven
  against and refuses otherwise, naming what differs).
* :func:`use_in_model`: once the model is built, on CPU engines: the CPU model's own DS4 / V4.1 attention
  modules take the core (their ``sparse_core``); refused for a model without one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from verl_ds4.engine.config import check_sparse_attention_backend, refuse_model_without_sparse_attention, sparse_attention_of

__all__ = ["prepare", "use_in_model"]

logger = logging.getLogger(__name__)


def prepare(engine_config, in_megatron: bool) -> list[str]:
    """Check the choice against the kernel backend; on a GPU engine (``in_megatron``) install the core into
    Megatron-LM dev. Returns the Megatron functions replaced (empty when nothing was installed)."""
    check_sparse_attention_backend(engine_config)
    if sparse_attention_of(engine_config) != "linear" or not in_megatron:
        return []
    from verl_ds4.mcore import sparse_attention_patch

    names = sparse_attention_patch.install()
    logger.info("verl-ds4: Megatron-LM dev's %s replaced by the memory-linear sparse attention", ", ".join(names))
    return names


def use_in_model(engine_config, module: Any, in_megatron: bool, unwrap: Callable[[Any], Any]) -> int:
    """On a CPU engine with ``sparse_attention=linear``, set the built model's attention modules to the core;
    returns how many took it (0 when there is nothing to do)."""
    if sparse_attention_of(engine_config) != "linear" or in_megatron:
        return 0
    from verl_ds4.kernels import set_sparse_core

    chunks = module if isinstance(module, (list, tuple)) else [module]
    taken = sum(set_sparse_core(unwrap(chunk), "linear") for chunk in chunks)
    if not taken:
        refuse_model_without_sparse_attention()
    return taken
