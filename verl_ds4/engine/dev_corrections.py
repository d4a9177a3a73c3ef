"""What verl-ds4's GPU DS4 engines change about Megatron-LM dev's DS4 at start-up, so that CP > 1 trains what CP 1 does
(docs/verify-cp.md, "The production model"; proven on the CPU production engine, which is such an engine):

* :func:`real_cu_seqlens`: the micro-batches hand dev's DS4 the real lengths in ``cu_seqlens_q`` / ``cu_seqlens_kv``
  (verl fills them with the padded ones, and dev's indexer loss counts every row inside ``cu_seqlens_q`` as a query);
* :func:`install`: fix 3 of :mod:`verl_ds4.substitutes.upstream_fixes` (dev's MTP loss is a mean over each CP rank's
  own tokens; made the rank's share of the CP-global mean, as verl's main loss is), at CP > 1.

``in_megatron``: the engine runs dev's own DS4 layers (the GPU engines and the CPU production engine); the CPU engines
that run verl-ds4's own model need neither (it takes the real lengths from the plan and has its own MTP loss).
"""

from __future__ import annotations

import logging
from typing import Any

from verl_ds4.mcore import resolver

__all__ = ["install", "real_cu_seqlens"]

logger = logging.getLogger(__name__)


def real_cu_seqlens(hf_config: Any, in_megatron: bool) -> bool:
    """Whether the engine's micro-batches carry the real lengths in ``cu_seqlens_q`` (``ResolvedCPLayout``)."""
    return bool(in_megatron and resolver.is_ds4_hf_config(hf_config))


def install(hf_config: Any, cp_size: int | None, in_megatron: bool) -> bool:
    """The MTP fix for the rest of the process; True if this call installed it (False where it is installed already,
    not needed, or dev no longer normalises per rank)."""
    from verl_ds4.substitutes import upstream_fixes

    installed = (real_cu_seqlens(hf_config, in_megatron) and int(cp_size or 1) > 1
                 and upstream_fixes.install_mtp_cp_token_share_for_process())
    if installed:
        logger.info("verl-ds4: Megatron-LM dev's process_mtp_loss normalised by the CP-global token count "
                    "(verl_ds4.substitutes.upstream_fixes, fix 3)")
    return installed
