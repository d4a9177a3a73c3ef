"""The one list of CPU substitutes, and :func:`install_all`, which applies them in a CPU process.

A GPU run of verl-ds4 builds Megatron-LM ``dev``'s DeepSeek-V4 through Megatron-Bridge's provider inside verl's
Megatron engine. On a CPU the same code runs, with exactly the stand-ins of :data:`SUBSTITUTES` for the pieces that
cannot run there (each the same math, or no math at all), and the guarded upstream fixes of :data:`UPSTREAM_FIXES`.
Everything else of the model is Megatron's and Bridge's own code. ``docs/architecture.md`` prints this list
(``tests/test_substitutes_on_cpu.py`` checks that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from .patching import Patches

__all__ = ["SUBSTITUTES", "UPSTREAM_FIXES", "Installed", "Substitute", "install_all"]


@dataclass(frozen=True)
class Substitute:
    """One stand-in: what it ``replaces`` upstream, the ``stand_in`` here, ``why`` the original cannot run on a CPU,
    and the test that ``checked`` it (against the original where the original can run)."""

    name: str
    replaces: str
    stand_in: str
    why: str
    checked: str


SUBSTITUTES: tuple[Substitute, ...] = (
    Substitute("triton at import", "module-level `import triton` in dev's megatron/core", "substitutes.imports (no-op module, import time only)",
               "triton is not installed on a CPU machine; its kernels are defined but never launched on the CPU path",
               "the whole model runs: test_production_path_on_cpu"),
    Substitute("TransformerEngine at Bridge import", "`import transformer_engine.pytorch` in megatron.bridge.peft.lora_layers",
               "substitutes.imports (placeholder, import time only; a megatron.core module imported under it is an error)",
               "TE needs CUDA; Bridge uses `te` only inside functions the CPU path does not call",
               "test_production_path_on_cpu (the import guard and its control)"),
    Substitute("TE backend spec", "`_get_backend_spec_provider` (asserts transformer_impl='transformer_engine') and the MTP block's TE backend",
               "substitutes.te_local.CPUSpecProvider (Megatron's LocalSpecProvider, LocalLinear as linear())",
               "TE modules need CUDA", "equality with transformers (test_production_path_on_cpu)"),
    Substitute("TELinear", "TELinear(parallel_mode='duplicated') in DS4 attention, compressor, indexer",
               "substitutes.te_local.LocalLinear (y = x W^T; registered with Bridge as replicated)",
               "TE needs CUDA", "equality with transformers"),
    Substitute("TE version gate", "TransformerConfig's sequence_packing_scheduler check (TE >= 2.9)",
               "substitutes.te_local: that one version answered as met; every other TE check unchanged",
               "no TE: get_te_version() is 0.0.0; the gate guards a TE convergence issue",
               "contiguous CP builds (test_production_path_on_cpu)"),
    Substitute("CuTe-DSL CP kernels", "cp_layout_kernels.CompressorInputCompact and build_attention_indices",
               "substitutes.cp_layout_kernels (CUDA tensors still go to the originals)",
               "CuTe-DSL kernels raise for CPU tensors",
               "test_cp_layout_kernels_cpu_on_cpu: equal to Megatron's pure-PyTorch references, both commits"),
    Substitute("Hadamard rotation", "dsa.rotate_activation (bf16 only, fast_hadamard_transform's CUDA kernel)",
               "substitutes.hadamard.rotate_activation (exact +-1 matrix, any dtype)",
               "fast_hadamard_transform is CUDA-only and asserts bf16",
               "test_production_path_on_cpu (H H = d I; fast_hadamard_transform where importable)"),
    Substitute("CUDA device / streams / NVTX / RNG", "torch.cuda.current_device, Stream, Event, nvtx, Megatron's CUDA RNG state",
               "substitutes.cuda_calls (CPU device, no-op streams and ranges, the CPU generator's state)",
               "a CPU-only torch raises on each", "the whole model runs"),
    Substitute("torch.compile", "@torch.compile on mHC and attention helpers", "substitutes.cuda_calls (dynamo disabled: eager)",
               "compiling on a CPU is slow and not what a GPU runs either; the functions are the same",
               "equality with transformers"),
    Substitute("CUDA literals in optimizer / DDP / schedule", "device='cuda' tensors, .cuda(), synchronize, current_stream",
               "substitutes.cuda_literals.cuda_literals_on_cpu (block-scoped redirect)",
               "a CPU-only torch has no CUDA device", "the CPU engine tests"),
    Substitute("top-k tie order", "torch.topk / Tensor.topk in dev's indexer and routers (ties in an unspecified order)",
               "substitutes.precision.stable_topk (equal scores in index order, via a stable sort; values and "
               "untied indices as torch.topk)",
               "a CPU torch.topk orders ties by its algorithm, which follows the tensor's shape: a tiny model's ReLU "
               "indexer scores tie (zeros), and CP ranks, CP 1 and the rollout would pick different keys",
               "test_substitutes_on_cpu (against torch.topk); the production RL runs' mismatch gate at 1e-5"),
    Substitute("fused kernels", "rope / permute / bias-dropout / softmax / layer-norm / cross-entropy fusion, "
               "gradient-accumulation fusion, shared-expert overlap, grouped GEMM (the DS4 provider turns them on)",
               "unfused Megatron paths (substitutes.provider_settings.CPU_OVERRIDES)",
               "each fusion is a CUDA / TE kernel", "equality with transformers"),
)


@dataclass(frozen=True)
class UpstreamFix:
    name: str
    upstream: str
    reproduction: str
    fix: str
    applied: str


UPSTREAM_FIXES: tuple[UpstreamFix, ...] = (
    UpstreamFix("MTP SequentialMLP mapping", "Megatron-Bridge 0.6.2 deepseek_v4_bridge.mapping_registry",
                "load a DS4 folder with num_nextn_predict_layers=1 into a model with moe_grouped_gemm=False: "
                "AttributeError: 'NoneType' object has no attribute 'megatron_module'",
                "substitutes.upstream_fixes.install_mtp_local_experts_mapping (only when the mapping is missing)",
                "always on the CPU path"),
    UpstreamFix("mHC RMS factor", "Megatron-LM dev hyper_connection.native_proj_rms: 1/(||x||/sqrt(K)+eps)",
                "x = 1e-3 * ones(16): factor 1/(1e-3+1e-6) vs the reference rsqrt(1e-6+1e-6), 2.9e-1 apart",
                "substitutes.upstream_fixes.install_reference_mhc_rms (only when dev differs)",
                "float64 proofs only (GPU runs keep Megatron's form)"),
    UpstreamFix("MTP loss under CP", "Megatron-LM dev multi_token_prediction.process_mtp_loss: scale * sum(local loss) / "
                "local tokens on each CP rank (calculate_per_token_loss off, verl's static-CP setting)",
                "tiny DS4, MTP depth 1, indexer loss off, 6 ragged sequences, float64: MTP gradients summed over CP 2 ranks "
                "1.0 relative off CP 1, 3e-15 with the fix (tests/production_cp_parity.py, cases mtp_unfixed / mtp)",
                "substitutes.upstream_fixes.install_mtp_cp_token_share (each rank's share of the CP-global token mean; "
                "only while dev normalises per rank, CP > 1)",
                "the CPU path, and verl-ds4's GPU DS4 engines at CP > 1"),
)


@dataclass
class Installed:
    """What :func:`install_all` did; :meth:`undo` restores every original."""

    patches: Patches
    kernels: list[str]
    reference_mhc_rms: bool

    def undo(self) -> None:
        global _INSTALLED
        from . import cp_layout_kernels

        cp_layout_kernels.uninstall()
        self.patches.undo()
        _INSTALLED = None


#: What :func:`install_all` installed in this process (None: nothing).
_INSTALLED: Installed | None = None


def install_all(*, reference_mhc_rms: bool = False) -> Installed:
    """Import Megatron-LM dev (already first on ``sys.path``, :func:`verl_ds4.substitutes.megatron_dev.use`) and
    Megatron-Bridge with the import stand-ins, then install every runtime substitute and the Bridge fix;
    ``reference_mhc_rms`` also the mHC fix (float64 proofs). CPU processes only. Installing again (every model a
    process builds calls it) adds only a fix not installed yet and returns the same :class:`Installed`."""
    global _INSTALLED
    from . import cp_layout_kernels, cuda_calls, imports, te_local, upstream_fixes
    from .hadamard import rotate_activation

    if _INSTALLED is not None:
        if reference_mhc_rms and not _INSTALLED.reference_mhc_rms:
            _INSTALLED.reference_mhc_rms = upstream_fixes.install_reference_mhc_rms(_INSTALLED.patches)
        return _INSTALLED
    imports.import_bridge()
    patches = Patches()
    cuda_calls.install(patches)
    te_local.install(patches)
    import importlib

    from megatron.core.transformer.experimental_attention_variant import csa, dsa

    patches.set(dsa, "rotate_activation", rotate_activation)
    patches.set(csa, "rotate_activation", rotate_activation)  # csa binds it by name
    kernels = cp_layout_kernels.install(importlib.import_module(csa.__name__.rsplit(".", 1)[0] + ".csa_utils.cp_layout_kernels"))
    upstream_fixes.install_mtp_local_experts_mapping(patches)
    from .precision import install_stable_topk

    install_stable_topk(patches)
    upstream_fixes.install_mtp_cp_token_share(patches)
    mhc = upstream_fixes.install_reference_mhc_rms(patches) if reference_mhc_rms else False
    _INSTALLED = Installed(patches, kernels, mhc)
    return _INSTALLED
