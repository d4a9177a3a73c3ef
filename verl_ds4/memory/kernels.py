"""The DS4 attention kernel path and recompute a recipe runs, checked at start-up against the GPU it names.

Megatron-LM ``dev`` (``transformer_config.py``, ``deepseek_v4_hybrid_attention.py``) refuses these at
model build, i.e. at step 1 on the GPUs; :func:`check_kernels` refuses them before anything starts,
with Megatron's reason and the fix:

* ``dsa_kernel_backend``: ``none`` (unfused PyTorch, the default) or ``cudnn`` (fused: FlashMLA +
  cuDNN-frontend, SM90 and SM100); ``tilelang`` is refused for DS4 (``dsv4_hybrid``);
* ``cudnn`` on SM90 (H100, H200) with the dense indexer loss (``dsa_indexer_loss_coeff > 0`` and
  ``dsa_indexer_use_sparse_loss`` false): "not reliable" on SM90, refused (SM100 allows it);
* ``sparse_attention`` (the engine's, recipe knob ``ds4.sparse_attention``): ``megatron`` or ``linear``
  (verl-ds4's memory-linear core, installed into the unfused path); ``linear`` with ``cudnn`` is refused:
  the fused kernels never call the core it replaces, so the setting would change nothing the memory check
  counts on;
* DeepSeek-V4.1: the recipes target Megatron-Bridge's ``DeepSeekV41ModelProvider`` (Megatron-LM dev with
  PR #7503), which refuses ``pipeline_model_parallel_size > 1`` and virtual pipeline stages;
* ``recompute_granularity``: ``selective`` needs ``recompute_modules`` (Megatron's default,
  ``core_attn``, is refused by DS4's attention); ``core_attn`` is refused; ``mhc`` with ``mlp`` is refused;
  ``full`` needs ``recompute_method`` and ``recompute_num_layers``; unknown module names are refused.

:data:`GPU_ARCH` maps the meshes' ``hardware`` names to their generation; an unknown one (a mesh with an
explicit ``gpu_memory_gib``) gets a warning when it runs the fused path.
"""

from __future__ import annotations

from typing import Any

from verl_ds4 import ds4_facts
from verl_ds4.memory.peak import DSA_BACKENDS, RECOMPUTE_MODULES
from verl_ds4.recipes.roles import Problem, _get

__all__ = ["GPU_ARCH", "check_kernels", "dense_indexer_loss"]

GPU_ARCH = {"H100-80GB": "sm90", "H200": "sm90", "B200": "sm100", "GB200": "sm100", "GB300": "sm100"}
_GRANULARITIES = ("selective", "full")


def dense_indexer_loss(otc: Any) -> bool:
    """Whether the engine trains Megatron's dense indexer loss (coefficient > 0, sparse loss off)."""
    return float(otc.get("dsa_indexer_loss_coeff") or 0.0) > 0 and not bool(otc.get("dsa_indexer_use_sparse_loss", False))


def _backend(otc: Any, where: str, hardware: Any, has_csa: bool, out: list[Problem], warnings: list[Problem]) -> None:
    arch = GPU_ARCH.get(str(hardware))
    backend = str(otc.get("dsa_kernel_backend") or "none")
    key = f"{where}.override_transformer_config.dsa_kernel_backend"
    if backend == "tilelang":
        out.append(Problem(
            key, "is 'tilelang', which Megatron-LM dev refuses for DeepSeek-V4 (dsv4_hybrid does not support it).",
            "set ds4.dsa_kernel_backend=cudnn for the fused CSA kernels or none for the PyTorch path.",
        ))
        return
    if backend not in DSA_BACKENDS.values():
        out.append(Problem(key, f"is {backend!r}; expected one of {sorted(DSA_BACKENDS.values())} (none: unfused, cudnn: fused).",
                           "set ds4.dsa_kernel_backend=none or cudnn."))
        return
    if backend != "cudnn":
        return
    if arch is None:
        warnings.append(Problem(key, f"is cudnn on hardware {hardware!r}, whose GPU generation the check does not know "
                                f"(known: {sorted(GPU_ARCH)}), so 'SM90 or newer' was not checked.",
                                "make sure the GPUs are SM90 (Hopper) or newer, or set ds4.dsa_kernel_backend=none."))
    elif arch == "sm90" and has_csa and dense_indexer_loss(otc):
        out.append(Problem(
            key, "is cudnn (fused DSA) with the dense indexer loss on SM90 (H100/H200), which Megatron-LM dev refuses: the cuDNN "
            "frontend's SM90 dense DSA kernels are not reliable for this path.",
            "set ds4.indexer_loss_coeff=0, or +<engine>.override_transformer_config.dsa_indexer_use_sparse_loss=true, "
            "or ds4.dsa_kernel_backend=none.",
        ))


def _sparse_attention(engine: Any, otc: Any, where: str, out: list[Problem]) -> None:
    """The engine's ``sparse_attention``: a known core, and ``linear`` only on the unfused backend that calls it."""
    value = engine.get("sparse_attention")
    if value is None:  # verl's own engine config (no field): Megatron's core
        return
    key = f"{where}.sparse_attention"
    if value not in ds4_facts.SPARSE_ATTENTION_CHOICES:
        out.append(Problem(key, f"is {value!r}; expected one of {list(ds4_facts.SPARSE_ATTENTION_CHOICES)} (megatron: Megatron-LM dev's "
                           "unfused core, backward quadratic in a GPU's tokens; linear: verl-ds4's memory-linear core).",
                           "set ds4.sparse_attention=linear or megatron."))
        return
    backend = str(otc.get("dsa_kernel_backend") or "none")
    if not ds4_facts.sparse_attention_applies(value, backend):
        out.append(Problem(
            key, f"is linear with dsa_kernel_backend={backend}: the fused kernels (FlashMLA + cuDNN frontend) never call the "
            "unfused core that linear replaces, so the setting would do nothing.",
            "set ds4.sparse_attention=megatron to keep the fused kernels, or ds4.dsa_kernel_backend=none to run the linear core.",
        ))


def _recompute(otc: Any, where: str, out: list[Problem]) -> None:
    granularity = otc.get("recompute_granularity")
    key = f"{where}.override_transformer_config"
    if granularity is None:
        return
    if granularity not in _GRANULARITIES:
        out.append(Problem(f"{key}.recompute_granularity", f"is {granularity!r}; expected null, selective or full.",
                           "set ds4.recompute_granularity=selective (with ds4.recompute_modules), full or null."))
        return
    if granularity == "full":
        missing = [k for k in ("recompute_method", "recompute_num_layers") if otc.get(k) is None]
        if missing:
            out.append(Problem(f"{key}.recompute_granularity", f"is full without {' and '.join(missing)}, which Megatron needs.",
                               "set ds4.recompute_method=uniform ds4.recompute_num_layers=1 (the recipes' full recompute)."))
        return
    per_layer = [k for k in ("recompute_method", "recompute_num_layers") if otc.get(k) is not None]
    if per_layer:  # the meshes set both for their full recompute; Megatron refuses them with selective
        out.append(Problem(f"{key}.recompute_granularity", f"is selective with {' and '.join(per_layer)} set, which Megatron "
                           "refuses at build (they belong to full recompute).",
                           "also set " + " ".join(f"ds4.{k}=null" for k in per_layer) + "."))
    raw = otc.get("recompute_modules")
    modules = [str(m) for m in (raw or [])]
    if raw is None:
        out.append(Problem(f"{key}.recompute_modules", "is null with recompute_granularity=selective: Megatron then recomputes "
                           "core_attn, which DeepSeek-V4's attention refuses.",
                           "name the modules, e.g. ds4.recompute_modules=[moe_act,mhc] (Megatron-Bridge's DS4 recipes)."))
    elif not modules:
        out.append(Problem(f"{key}.recompute_modules", "is empty with recompute_granularity=selective: Megatron then recomputes "
                           "nothing, which is no recompute at all under another name.",
                           "name the modules, e.g. ds4.recompute_modules=[moe_act,mhc], or set ds4.recompute_granularity=null."))
    if "core_attn" in modules:
        out.append(Problem(f"{key}.recompute_modules", "contains core_attn: Megatron-LM dev refuses checkpointing the core attention "
                           "of DeepSeek-V4's hybrid attention.", "drop core_attn; recompute moe_act, mhc or mla_up_proj instead."))
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES) - {"core_attn"})
    if unknown:
        out.append(Problem(f"{key}.recompute_modules", f"has {unknown}, not modules DeepSeek-V4 recomputes; known: {list(RECOMPUTE_MODULES)}.",
                           "use the known names (Megatron's recompute_modules)."))
    if "mhc" in modules and "mlp" in modules:
        out.append(Problem(f"{key}.recompute_modules", "has both mhc and mlp, which Megatron refuses together.",
                           "keep one of them (the recipes use mhc with moe_act)."))


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
    ratios = getattr(sizes, "compress_ratios", ()) if sizes is not None else ()
    has_csa = not ratios or ds4_facts.CSA_RATIO in ratios or any(0 < r < ds4_facts.CSA_RATIO for r in ratios)
    seen: set[str] = set()
    for role in report.roles:
        if role.role == "ref":  # verl builds the reference from the actor's engine block
            continue
        engine = _get(cfg, role.engine_key) or {}
        otc = engine.get("override_transformer_config") or {}
        if role.engine_key in seen:
            continue
        seen.add(role.engine_key)
        _backend(otc, role.engine_key, hardware, has_csa, report.errors, report.warnings)
        _sparse_attention(engine, otc, role.engine_key, report.errors)
        _recompute(otc, role.engine_key, report.errors)
