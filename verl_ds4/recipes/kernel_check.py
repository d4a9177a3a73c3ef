"""Start-up check of the DS4 attention kernel path and recompute of every engine a recipe builds.

Reads each engine block once into a :class:`~verl_ds4.memory.types.KernelSettings`
(:func:`verl_ds4.recipes.memory_inputs.kernel_settings`), asks :func:`verl_ds4.memory.kernels.kernel_findings`
what Megatron-LM ``dev`` would refuse at model build on the mesh's GPU, and adds those findings to the
validation report. DeepSeek-V4.1: the recipes target Megatron-Bridge's ``DeepSeekV41ModelProvider``
(Megatron-LM dev with PR #7503), which refuses ``pipeline_model_parallel_size > 1`` and virtual pipeline stages.
"""

from __future__ import annotations

from typing import Any

from verl_ds4.memory.kernels import has_csa, kernel_findings
from verl_ds4.recipes.memory_inputs import kernel_settings
from verl_ds4.recipes.roles import Problem, _get

__all__ = ["check_kernels"]


def _v41_provider(report) -> None:
    """V4.1 recipes target Megatron-Bridge's ``DeepSeekV41ModelProvider``, which refuses PP > 1 and VPP at build."""
    for role in report.roles:
        if role.pp > 1 or (role.vpp or 1) > 1:
            report.errors.append(Problem(
                f"{role.engine_key}.pipeline_model_parallel_size",
                f"is {role.pp} (VPP {role.vpp}) for DeepSeek-V4.1, whose Megatron-Bridge provider (DeepSeekV41ModelProvider) "
                "refuses pipeline parallelism and virtual pipeline stages (the native Megatron-Core DeepSeekV41Model needs "
                "PP = 1).",
                "set ds4.mesh.pp=1 ds4.mesh.vpp=null and spread the experts over EP (the shipped V4.1 meshes: *_pp1_*).",
            ))
            return


def check_kernels(cfg: Any, report) -> None:
    """Add the kernel-path and recompute findings of every engine of ``report.roles`` to ``report`` (and, for
    DeepSeek-V4.1, the pipeline layout its Megatron-Bridge provider accepts)."""
    if hasattr(report.facts.sizes, "roles"):
        _v41_provider(report)
    hardware = _get(cfg, "ds4.mesh.hardware")
    sizes = report.facts.sizes
    csa = has_csa(getattr(sizes, "compress_ratios", ()) if sizes is not None else ())
    seen: set[str] = set()
    for role in report.roles:
        if role.role == "ref" or role.engine_key in seen:  # verl builds the reference from the actor's engine block
            continue
        seen.add(role.engine_key)
        errors, warnings = kernel_findings(kernel_settings(_get(cfg, role.engine_key) or {}, role.engine_key), hardware, csa)
        report.errors.extend(errors)
        report.warnings.extend(warnings)
