"""The production model on CPU: Megatron-LM ``dev``'s DeepSeek-V4, built by Megatron-Bridge's provider as verl does.

verl 0.9.1's Megatron engine (``use_mbridge=True``, ``vanilla_mbridge=False``) builds a DS4 in four calls:
``AutoBridge.from_hf_pretrained(path)``, ``bridge.to_megatron_provider(load_weights=False)``,
``provider.apply_overrides_and_finalize(dtype, overrides)`` with its engine overrides (parallel sizes,
``variable_seq_lengths``, the alltoall dispatcher, no load balancing, and for DS4 with CP the contiguous partition
and the ``default_dynamic_cp`` scheduler), then ``provider.provide_distributed_model`` and
``bridge.load_hf_weights``. :class:`ProductionBuilder` makes the same calls, with the CPU settings of
:data:`CPU_OVERRIDES` added (the fusions the DS4 provider turns on are CUDA kernels) and the substitutes of
:mod:`verl_ds4.substitutes.registry` installed. It runs in a process whose ``megatron`` is Megatron-LM ``dev``
(:func:`verl_ds4.substitutes.megatron_dev.use` before anything imports megatron).

:class:`ProductionLM` gives the built ``GPTModel`` the forward signature of verl-ds4's own DS4
(``model(ids, position_ids, attention_mask, packed_seq_params=...)``), so the project's CP harness
(:func:`verl_ds4.models.ds4.hf_check.run_on_cp_ranks`) packs, runs and gathers it exactly as it does its own model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

__all__ = ["CPU_OVERRIDES", "ProductionBuilder", "ProductionLM", "UnmappableFolder", "check_mappable", "verl_overrides"]

#: Provider settings a CPU needs beside verl's: no fused (CUDA / TransformerEngine) kernel, CPU initialisation,
#: SequentialMLP experts (grouped GEMM is a TE kernel), Megatron's local modules.
CPU_OVERRIDES: dict[str, Any] = {
    "use_cpu_initialization": True,
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "moe_permute_fusion": False,
    "moe_grouped_gemm": False,
    "moe_shared_expert_overlap": False,
    "cross_entropy_loss_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "use_fused_mhc": False,
    "apply_dsa_kernel_fusion": False,
}


class UnmappableFolder(ValueError):
    """An HF folder whose tensors Megatron-Bridge cannot map onto the model."""


def verl_overrides(cp_size: int) -> dict[str, Any]:
    """The provider overrides verl 0.9.1's ``_build_tf_config`` applies (TP = PP = EP = 1 on a CPU)."""
    from megatron.core.transformer.enums import AttnBackend

    overrides = {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": cp_size, "sequence_parallel": False, "overlap_p2p_comm": False,
        "batch_p2p_comm": False, "variable_seq_lengths": True, "attention_backend": AttnBackend.flash,
        "moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type": "none",
    }
    if cp_size > 1:  # verl's DS4 rule
        overrides.update(cp_partition_mode="contiguous", sequence_packing_scheduler="default_dynamic_cp")
    return overrides


def check_mappable(bridge, model_chunks, folder: str | Path) -> None:
    """Refuse, naming the tensors, a folder Bridge cannot load: a model parameter without a mapping, or a mapping
    whose HF tensor the folder lacks (Bridge 0.6.2 would log a warning and then fail on a ``None`` task)."""
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    model_bridge = get_model_bridge(bridge.hf_pretrained.config.architectures[0])
    model_bridge.hf_config = bridge.hf_pretrained.config
    registry = model_bridge.mapping_registry()
    keys = set(bridge.hf_pretrained.state.source.get_all_keys())
    unmapped, missing = [], []
    for name, _ in model_chunks[0].named_parameters():
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            unmapped.append(name)
            continue
        wanted = mapping.hf_param.values() if isinstance(mapping.hf_param, dict) else [mapping.hf_param]
        if not getattr(mapping, "allow_hf_name_mismatch", False):
            missing += [w for w in wanted if w not in keys]
    if unmapped or missing:
        raise UnmappableFolder(
            f"Megatron-Bridge cannot load {folder} into Megatron-LM dev's DS4: "
            + (f"no mapping for the model's {unmapped[:5]}{' ...' if len(unmapped) > 5 else ''}; " if unmapped else "")
            + (f"tensors missing from the folder: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}; " if missing else "")
            + "expected a DeepSeek-V4 folder in DeepSeek's native names (embed.weight, layers.N.attn.wq_a.weight, "
            "mtp.K.*) matching its config.json; write one with `verl-ds4 ...` or re-export it from transformers "
            "(verl_ds4.models.ds4.hf_checkpoint.save_hf_checkpoint(..., family='native')).")


class ProductionLM(torch.nn.Module):
    """The Bridge-built ``GPTModel`` behind verl-ds4's DS4 forward signature (logits ``[1, rows, vocab]``)."""

    def __init__(self, gpt_model: torch.nn.Module):
        super().__init__()
        self.gpt = gpt_model
        self.config = gpt_model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, *, packed_seq_params=None, hash_token_ids=None, **kw):
        if hash_token_ids is not None:
            raise ValueError("the production model reads hash-routing ids from input_ids; hash_token_ids is not taken")
        return self.gpt(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                        packed_seq_params=packed_seq_params, **kw)


class ProductionBuilder:
    """``builder(cp_size) -> ProductionLM`` on an initialised Megatron parallel state (one per CP rank).

    ``dtype`` float64 builds and runs inside :func:`verl_ds4.substitutes.precision.fp64_reference` (Megatron's float32
    casts become float64); ``reference_mhc_rms`` also applies the mHC fix of :mod:`verl_ds4.substitutes.upstream_fixes`.
    """

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, *, reference_mhc_rms: bool = False):
        self.folder, self.dtype, self.reference_mhc_rms = str(folder), dtype, reference_mhc_rms

    def precision(self):
        from verl_ds4.substitutes.precision import StableTopK, fp64_reference

        return fp64_reference() if self.dtype == torch.float64 else StableTopK()

    def __call__(self, cp_size: int) -> ProductionLM:
        from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
        from verl_ds4.substitutes.registry import install_all

        install_all(reference_mhc_rms=self.reference_mhc_rms)
        from megatron.bridge import AutoBridge

        bridge = AutoBridge.from_hf_pretrained(self.folder)
        provider = bridge.to_megatron_provider(load_weights=False)
        provider.apply_overrides_and_finalize(dtype=self.dtype, overrides={**verl_overrides(cp_size), **CPU_OVERRIDES})
        with cuda_literals_on_cpu(), self.precision():
            chunks = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        check_mappable(bridge, chunks, self.folder)
        with cuda_literals_on_cpu(), _quiet_progress():
            bridge.load_hf_weights(chunks, self.folder)
        return _PrecisionLM(ProductionLM(chunks[0]).eval(), self.precision)


class _PrecisionLM(ProductionLM):
    """Runs every forward inside the builder's precision context (fp64 promotion / the stable top-k)."""

    def __init__(self, inner: ProductionLM, precision):
        super().__init__(inner.gpt)
        self._precision = precision

    def forward(self, *args, **kwargs):
        with self._precision():
            return super().forward(*args, **kwargs)


@contextlib.contextmanager
def _quiet_progress():
    """Bridge draws a progress bar per load; the proofs print their own lines."""
    import logging

    level = logging.getLogger("megatron.bridge").level
    logging.getLogger("megatron.bridge").setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger("megatron.bridge").setLevel(level)
