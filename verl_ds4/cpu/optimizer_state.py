"""Adam state repairs for resuming Megatron's distributed optimizer on the CPU (no TE/Apex).

torch's Adam creates its ``step`` state lazily; Megatron's distributed optimizer reads it while
building the state dict to load into, so :func:`create_empty_optimizer_state` creates it first
(zeros, no parameter update). Megatron-Core 0.16's non-TE/Apex load path then shares one ``step``
tensor between all parameters; :func:`restore_adam_step_counters` gives each its own.
"""

from __future__ import annotations

import torch

__all__ = ["create_empty_optimizer_state", "restore_adam_step_counters"]


def _inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _inner_torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def create_empty_optimizer_state(optimizer) -> None:
    """Give every Adam parameter a zero state (``step=0``, zero moments) if it has none.

    Megatron's distributed optimizer reads ``state['step']`` while building the state dict
    that a checkpoint is loaded into; torch's Adam only creates it on the first step. The
    loaded checkpoint overwrites these values. Parameters are not touched.
    """
    for inner in _inner_torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
                    if group.get("amsgrad"):
                        state.setdefault("max_exp_avg_sq", torch.zeros_like(param))


def restore_adam_step_counters(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor, set to the checkpoint's step.

    Without TransformerEngine/Apex, Megatron-Core 0.16's ``DistributedOptimizer`` stores the
    Adam step in each checkpointed param group (``param_group["step"]``) and on load assigns
    *one* tensor object to every parameter's ``state["step"]``; the per-parameter state copy
    that follows then writes the pre-load placeholder into that shared tensor, and torch's
    Adam would increment it in place once per parameter. Both would change every bias
    correction after a resume. The loaded param groups keep the true value.
    """
    for inner in _inner_torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            if group["step"] is None:
                continue
            step = float(group["step"])
            for param in group["params"]:
                state = inner.state.get(param)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)
