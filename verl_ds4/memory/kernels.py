"""The DS4 attention kernel path and recompute an engine runs, checked against the GPU it names (pure Python).

Megatron-LM ``dev`` (``transformer_config.py``, ``deepseek_v4_hybrid_attention.py``) refuses these at
model build, i.e. at step 1 on the GPUs; :func:`kernel_findings` finds them in one engine's
:class:`~verl_ds4.memory.types.KernelSettings` before anything starts, with Megatron's reason and the fix
(:mod:`verl_ds4.recipes.kernel_check` reads the settings and refuses the recipe):

* ``dsa_kernel_backend``: ``none`` (unfused PyTorch, the default) or ``cudnn`` (fused: FlashMLA +
  cuDNN-frontend, SM90 and SM100); ``tilelang`` is refused for DS4 (``dsv4_hybrid``);
* ``cudnn`` on SM90 (H100, H200) with the dense indexer loss (``dsa_indexer_loss_coeff > 0`` and
  ``dsa_indexer_use_sparse_loss`` false): "not reliable" on SM90, refused (SM100 allows it);
* ``sparse_attention`` (the engine's, recipe knob ``ds4.sparse_attention``): ``megatron`` or ``linear``
  (verl-ds4's memory-linear core, installed into the unfused path); ``linear`` with ``cudnn`` is refused:
  the fused kernels never call the core it replaces, so the setting would change nothing the memory check
  counts on;
* ``recompute_granularity``: ``selective`` needs ``recompute_modules`` (Megatron's default,
  ``core_attn``, is refused by DS4's attention); ``core_attn`` is refused; ``mhc`` with ``mlp`` is refused;
  ``full`` needs ``recompute_method`` and ``recompute_num_layers``; unknown module names are refused.

:data:`GPU_ARCH` maps the meshes' ``hardware`` names to their generation; an unknown one (a mesh with an
explicit ``gpu_memory_gib``) gets a warning when it runs the fused path.
"""

from __future__ import annotations

from verl_ds4 import ds4_facts
from verl_ds4.memory.peak import DSA_BACKENDS, RECOMPUTE_MODULES
from verl_ds4.memory.types import Finding, KernelSettings

__all__ = ["GPU_ARCH", "has_csa", "kernel_findings"]

GPU_ARCH = {"H100-80GB": "sm90", "H200": "sm90", "B200": "sm100", "GB200": "sm100", "GB300": "sm100"}
_GRANULARITIES = ("selective", "full")


def has_csa(compress_ratios) -> bool:
    """Whether a model of these layer ratios has top-k (CSA) layers (no ratios known: assume it does)."""
    ratios = tuple(compress_ratios or ())
    return not ratios or ds4_facts.CSA_RATIO in ratios or any(0 < r < ds4_facts.CSA_RATIO for r in ratios)


def _backend(k: KernelSettings, hardware, csa: bool, out: list[Finding], warnings: list[Finding]) -> None:
    arch = GPU_ARCH.get(str(hardware))
    backend = k.dsa_kernel_backend
    key = f"{k.engine_key}.override_transformer_config.dsa_kernel_backend"
    if backend == "tilelang":
        out.append(Finding(
            key, "is 'tilelang', which Megatron-LM dev refuses for DeepSeek-V4 (dsv4_hybrid does not support it).",
            "set ds4.dsa_kernel_backend=cudnn for the fused CSA kernels or none for the PyTorch path.",
        ))
        return
    if backend not in DSA_BACKENDS.values():
        out.append(Finding(key, f"is {backend!r}; expected one of {sorted(DSA_BACKENDS.values())} (none: unfused, cudnn: fused).",
                           "set ds4.dsa_kernel_backend=none or cudnn."))
        return
    if backend != "cudnn":
        return
    if arch is None:
        warnings.append(Finding(key, f"is cudnn on hardware {hardware!r}, whose GPU generation the check does not know "
                                f"(known: {sorted(GPU_ARCH)}), so 'SM90 or newer' was not checked.",
                                "make sure the GPUs are SM90 (Hopper) or newer, or set ds4.dsa_kernel_backend=none."))
    elif arch == "sm90" and csa and k.dense_indexer_loss:
        out.append(Finding(
            key, "is cudnn (fused DSA) with the dense indexer loss on SM90 (H100/H200), which Megatron-LM dev refuses: the cuDNN "
            "frontend's SM90 dense DSA kernels are not reliable for this path.",
            "set ds4.indexer_loss_coeff=0, or +<engine>.override_transformer_config.dsa_indexer_use_sparse_loss=true, "
            "or ds4.dsa_kernel_backend=none.",
        ))


def _sparse_attention(k: KernelSettings, out: list[Finding]) -> None:
    """The engine's ``sparse_attention``: a known core, and ``linear`` only on the unfused backend that calls it."""
    value = k.sparse_attention
    if value is None:  # verl's own engine config (no field): Megatron's core
        return
    key = f"{k.engine_key}.sparse_attention"
    if value not in ds4_facts.SPARSE_ATTENTION_CHOICES:
        out.append(Finding(key, f"is {value!r}; expected one of {list(ds4_facts.SPARSE_ATTENTION_CHOICES)} (megatron: Megatron-LM dev's "
                           "unfused core, backward quadratic in a GPU's tokens; linear: verl-ds4's memory-linear core).",
                           "set ds4.sparse_attention=linear or megatron."))
        return
    backend = k.dsa_kernel_backend
    if not ds4_facts.sparse_attention_applies(value, backend):
        out.append(Finding(
            key, f"is linear with dsa_kernel_backend={backend}: the fused kernels (FlashMLA + cuDNN frontend) never call the "
            "unfused core that linear replaces, so the setting would do nothing.",
            "set ds4.sparse_attention=megatron to keep the fused kernels, or ds4.dsa_kernel_backend=none to run the linear core.",
        ))


def _recompute(k: KernelSettings, out: list[Finding]) -> None:
    granularity = k.recompute_granularity
    key = f"{k.engine_key}.override_transformer_config"
    if granularity is None:
        return
    if granularity not in _GRANULARITIES:
        out.append(Finding(f"{key}.recompute_granularity", f"is {granularity!r}; expected null, selective or full.",
                           "set ds4.recompute_granularity=selective (with ds4.recompute_modules), full or null."))
        return
    if granularity == "full":
        missing = [name for name, v in (("recompute_method", k.recompute_method), ("recompute_num_layers", k.recompute_num_layers))
                   if v is None]
        if missing:
            out.append(Finding(f"{key}.recompute_granularity", f"is full without {' and '.join(missing)}, which Megatron needs.",
                               "set ds4.recompute_method=uniform ds4.recompute_num_layers=1 (the recipes' full recompute)."))
        return
    per_layer = [name for name, v in (("recompute_method", k.recompute_method), ("recompute_num_layers", k.recompute_num_layers))
                 if v is not None]
    if per_layer:  # the meshes set both for their full recompute; Megatron refuses them with selective
        out.append(Finding(f"{key}.recompute_granularity", f"is selective with {' and '.join(per_layer)} set, which Megatron "
                           "refuses at build (they belong to full recompute).",
                           "also set " + " ".join(f"ds4.{name}=null" for name in per_layer) + "."))
    modules = list(k.recompute_modules or ())
    if k.recompute_modules is None:
        out.append(Finding(f"{key}.recompute_modules", "is null with recompute_granularity=selective: Megatron then recomputes "
                           "core_attn, which DeepSeek-V4's attention refuses.",
                           "name the modules, e.g. ds4.recompute_modules=[moe_act,mhc] (Megatron-Bridge's DS4 recipes)."))
    elif not modules:
        out.append(Finding(f"{key}.recompute_modules", "is empty with recompute_granularity=selective: Megatron then recomputes "
                           "nothing, which is no recompute at all under another name.",
                           "name the modules, e.g. ds4.recompute_modules=[moe_act,mhc], or set ds4.recompute_granularity=null."))
    if "core_attn" in modules:
        out.append(Finding(f"{key}.recompute_modules", "contains core_attn: Megatron-LM dev refuses checkpointing the core attention "
                           "of DeepSeek-V4's hybrid attention.", "drop core_attn; recompute moe_act, mhc or mla_up_proj instead."))
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES) - {"core_attn"})
    if unknown:
        out.append(Finding(f"{key}.recompute_modules", f"has {unknown}, not modules DeepSeek-V4 recomputes; known: {list(RECOMPUTE_MODULES)}.",
                           "use the known names (Megatron's recompute_modules)."))
    if "mhc" in modules and "mlp" in modules:
        out.append(Finding(f"{key}.recompute_modules", "has both mhc and mlp, which Megatron refuses together.",
                           "keep one of them (the recipes use mhc with moe_act)."))


def kernel_findings(k: KernelSettings, hardware, csa: bool) -> tuple[list[Finding], list[Finding]]:
    """(errors, warnings) of one engine's kernel path and recompute on ``hardware`` (``ds4.mesh.hardware``);
    ``csa``: the model has top-k layers (:func:`has_csa`)."""
    errors: list[Finding] = []
    warnings: list[Finding] = []
    _backend(k, hardware, csa, errors, warnings)
    _sparse_attention(k, errors)
    _recompute(k, errors)
    return errors, warnings
