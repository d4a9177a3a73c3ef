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

from verl_ds4.substitutes.environment import BRIDGE_VERSION, no_torch_function_mode, quiet_progress, require_bridge, require_megatron_dev
from verl_ds4.substitutes.provider_settings import CPU_OVERRIDES

__all__ = ["BRIDGE_VERSION", "CPU_OVERRIDES", "ProductionBuilder", "ProductionLM", "ProductionModels", "UnmappableFolder", "check_mappable",
           "released_megatron_env", "require_bridge", "require_megatron_dev", "verl_overrides", "write_harness_folder"]


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


def check_mappable(bridge, model_chunks, folder: str | Path, allowed: tuple[str, ...] = ()) -> None:
    """Refuse, naming the tensors, a folder Bridge cannot load: a model parameter without a mapping, or a mapping
    whose HF tensor the folder lacks (Bridge 0.6.2 would log a warning and then fail on a ``None`` task)."""
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    model_bridge = get_model_bridge(bridge.hf_pretrained.config.architectures[0])
    model_bridge.hf_config = bridge.hf_pretrained.config
    registry = model_bridge.mapping_registry()
    keys = set(bridge.hf_pretrained.state.source.get_all_keys())
    unmapped, missing = [], []
    for name, _ in model_chunks[0].named_parameters():
        if name in allowed:
            continue
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            unmapped.append(name)
            continue
        wanted = mapping.hf_param.values() if isinstance(mapping.hf_param, dict) else [mapping.hf_param]
        # Mappings Bridge marks optional (compressor, indexer) are still required once the model has the parameter;
        # the indexer's scorer may carry its legacy name (as Bridge's own loader accepts)
        missing += [w for w in wanted if w not in keys and _legacy_name(w) not in keys]
    if unmapped or missing:
        raise UnmappableFolder(
            f"Megatron-Bridge cannot load {folder} into Megatron-LM dev's DS4: "
            + (f"no mapping for the model's {unmapped[:5]}{' ...' if len(unmapped) > 5 else ''}; " if unmapped else "")
            + (f"tensors missing from the folder: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}; " if missing else "")
            + "expected a DeepSeek-V4 folder in DeepSeek's native names (embed.weight, layers.N.attn.wq_a.weight, "
            "mtp.K.*) matching its config.json; a folder in transformers' names re-saves in native ones with "
            "verl_ds4.models.ds4.hf_checkpoint (load_hf_checkpoint, then save_hf_checkpoint(model, folder, family='native')).")


#: The FP8 block Megatron-Bridge 0.6.2 reads (``quantization_utils`` tiles scales 128 x 128 whatever the config says).
BRIDGE_FP8_BLOCK = [128, 128]


def check_block_size(folder: str | Path) -> None:
    """Refuse an FP8 folder whose ``weight_block_size`` is not 128 x 128: Bridge 0.6.2 would read its scales as
    128 x 128 blocks anyway and load other weights without a word (the hub's DeepSeek-V4 folders are 128 x 128)."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if block is not None and list(block) != BRIDGE_FP8_BLOCK:
        raise UnmappableFolder(
            f"{folder}: quantization_config.weight_block_size is {list(block)}, and Megatron-Bridge {BRIDGE_VERSION} reads FP8 "
            f"scales as {BRIDGE_FP8_BLOCK[0]} x {BRIDGE_FP8_BLOCK[1]} blocks whatever the config says, so it would load other "
            "weights. Give the folder in 128 x 128 blocks (as the hub ships DeepSeek-V4), or dequantised (bf16 / fp32).")


def _legacy_name(hf_name: str) -> str:
    return hf_name.replace(".indexer.scorer.weights_proj.", ".indexer.weights_proj.")


class ProductionLM(torch.nn.Module):
    """The Bridge-built ``GPTModel`` behind verl-ds4's DS4 forward signature (logits ``[1, rows, vocab]``)."""

    def __init__(self, gpt_model: torch.nn.Module):
        super().__init__()
        self.gpt = gpt_model
        self.config = gpt_model.config

    #: A negative control only: rows packed with another layout handed over as contiguous (dev's guard reads the label).
    relabel_contiguous = False
    #: The harness hands this model the real lengths in cu_seqlens_q, as verl-ds4's DS4 engines do for dev's DS4
    #: (``ResolvedCPLayout.real_cu_seqlens``); a test sets it False for the negative control (verl's padded lengths).
    real_cu_seqlens = True

    @property
    def mtp_block(self):
        """dev's MTP block (None without MTP): the harness passes the real-token loss mask to a model that has one
        (without it dev's MTP loss counts the layout's padding rows at CP > 1)."""
        return getattr(self.gpt, "mtp", None)

    def forward(self, input_ids, position_ids=None, attention_mask=None, *, packed_seq_params=None, hash_token_ids=None, **kw):
        if self.relabel_contiguous and packed_seq_params is not None:
            import dataclasses

            packed_seq_params = dataclasses.replace(packed_seq_params, cp_partition_mode="contiguous")
        if hash_token_ids is not None:
            raise ValueError("the production model reads hash-routing ids from input_ids; hash_token_ids is not taken")  # error-catalogue: internal (the harness's own-model control)
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

    def __call__(self, cp_size: int, *, value_head: bool = False, overrides: dict | None = None) -> ProductionLM:
        """The model of this rank. ``value_head``: verl's critic (Bridge's value-head hook replaces the output layer,
        the MTP layers are dropped as verl drops them when MTP is off); ``overrides``: more provider settings."""
        from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
        from verl_ds4.substitutes.registry import install_all

        require_bridge()
        check_block_size(self.folder)
        install_all(reference_mhc_rms=self.reference_mhc_rms)
        from megatron.bridge import AutoBridge

        bridge = AutoBridge.from_hf_pretrained(self.folder)
        provider = bridge.to_megatron_provider(load_weights=False)
        settings = {**verl_overrides(cp_size), **CPU_OVERRIDES, **(overrides or {})}
        if self.dtype == torch.float64:
            # the router's autograd function casts to this dtype in backward, outside any torch-function mode
            settings["moe_router_dtype"] = "fp64"
        if value_head:
            from megatron.bridge.training.utils.train_utils import make_value_model

            settings["share_embeddings_and_output_weights"] = False
            if getattr(provider, "mtp_num_layers", 0):  # verl's rule for a model without MTP
                settings["mtp_num_layers"] = 0
                settings["csa_compress_ratios"] = list(provider.csa_compress_ratios)[: provider.num_layers]
            provider.register_pre_wrap_hook(make_value_model(provider.hidden_size, False))
        if settings.get("dsa_indexer_loss_coeff", getattr(provider, "dsa_indexer_loss_coeff", None)) is None:
            # dev's unfused THD path at CP 1 multiplies by the raw config value (csa.py getattr(..., 0.0) finds
            # None and raises TypeError in a training forward); None means 0 everywhere else in dev (`or 0.0`)
            settings["dsa_indexer_loss_coeff"] = 0.0
        provider.apply_overrides_and_finalize(dtype=self.dtype, overrides=settings)
        with cuda_literals_on_cpu(), self.precision():
            chunks = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        check_mappable(bridge, chunks, self.folder, allowed=("output_layer.weight",) if value_head else ())
        with cuda_literals_on_cpu(), quiet_progress(), no_torch_function_mode():
            bridge.load_hf_weights(chunks, self.folder,
                                   allowed_mismatched_params=["output_layer.weight"] if value_head else None)
        return _PrecisionLM(ProductionLM(chunks[0]).eval(), self.precision)


class _PrecisionLM(ProductionLM):
    """Runs every forward inside the builder's precision context (fp64 promotion / the stable top-k)."""

    def __init__(self, inner: ProductionLM, precision):
        super().__init__(inner.gpt)
        self._precision = precision

    def forward(self, *args, **kwargs):
        with self._precision():
            return super().forward(*args, **kwargs)


def released_megatron_env() -> dict:
    """The environment of a child interpreter that imports the released megatron-core: this one's, without
    ``MEGATRON_DEV_DIR`` and without a Megatron-LM dev tree on ``PYTHONPATH``."""
    import os
    import sys

    from verl_ds4.substitutes.megatron_dev import roots_on_path

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_DEV_DIR"}
    dev_roots = set(roots_on_path())
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and p not in dev_roots)
    return env


def write_harness_folder(cfg, seed: int, timeout: float = 300.0) -> str:
    """Write the parity harness's tiny DS4 (its seeded weights, hash table and expert bias) as a DeepSeek-native HF
    folder in a temporary directory, from a child interpreter that imports the released megatron-core (verl-ds4's own
    model is built on it, not on Megatron-LM dev). Returns the folder."""
    import json
    import subprocess
    import sys
    import tempfile

    folder = tempfile.mkdtemp(prefix="verl_ds4_production_")
    args = json.dumps({"cfg": cfg if cfg is None or isinstance(cfg, (dict, str)) else str(cfg), "seed": seed, "folder": folder})
    done = subprocess.run([sys.executable, "-m", "verl_ds4.verify.production_weights", args], env=released_megatron_env(), text=True,
                          capture_output=True, timeout=timeout)
    if done.returncode != 0 or not (Path(folder) / "model.safetensors").is_file():
        raise RuntimeError(f"writing the harness's DS4 folder failed (exit {done.returncode}): {done.stderr[-2000:]}")  # error-catalogue: passes on the child's own error
    return folder


class ProductionModels:
    """The parity harness's models (``verify --engine production``): the harness's tiny DS4 with its seeded weights
    (:class:`verl_ds4.verify.parity._Models`, the project's own model) written as a DeepSeek-native HF folder, then
    built through :class:`ProductionBuilder`. Both engines therefore run the same weights, and their CP = 1 results
    can be compared number for number (the production model against the project's model)."""

    def __init__(self, models, cp_size: int, folder: str | Path, *, reference_mhc_rms: bool = True):
        self.inner, self.folder, self.cp_size, self.reference_mhc_rms = models, Path(folder), cp_size, reference_mhc_rms
        self.cfg, self.vocab, self.seed = models.cfg, models.vocab, models.seed
        self.indexer_loss_coeff = models.indexer_loss_coeff
        self.has_hash_layers = False  # the hash-ids control is the project's model's (its forward takes shifted ids)
        self._fp64 = None


    def build(self, dtype, value_head: bool = False, device=None, overrides: dict | None = None):
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("the production model runs on the CPU here (its substitutes are CPU stand-ins)")  # error-catalogue: internal (verify refuses --device first)
        settings = dict(overrides or {})
        if not value_head:
            settings["dsa_indexer_loss_coeff"] = self.indexer_loss_coeff
        model = ProductionBuilder(self.folder, dtype, reference_mhc_rms=self.reference_mhc_rms)(
            self.cp_size, value_head=value_head, overrides=settings)
        if dtype == torch.float64 and self._fp64 is None:
            # Megatron's autograd functions cast in backward too (the router's weight.to(float32)): after its first
            # build (loading safetensors must not be promoted) the rank keeps the float64 promotion on for its whole
            # life, forward and backward (it is a process of its own).
            from verl_ds4.substitutes.patching import Patches
            from verl_ds4.substitutes.precision import float_keeps_float64, fp64_reference

            self._fp64 = fp64_reference()
            self._fp64.__enter__()
            float_keeps_float64(Patches())  # and in the backward of Megatron's autograd functions
        if value_head:  # Bridge's hook initialises the value head from the process's RNG: seed it, as on every CP size
            head = model.gpt.output_layer.weight
            gen = torch.Generator().manual_seed(self.seed + 11)
            with torch.no_grad():
                head.copy_((0.02 * torch.randn(head.shape, generator=gen, dtype=torch.float64)).to(head.dtype))
        return model.train()

    def use_sparse_core(self, model, core: str) -> None:
        """``linear``: verl-ds4's memory-linear sparse attention in dev's own layers, as ``ds4.sparse_attention=linear``
        installs it on a GPU (:mod:`verl_ds4.mcore.sparse_attention_patch`: dev's four ``csa`` functions replaced
        after the check that they are the proven ones); the layers call them at run time, so built models use it."""
        if core != "linear":
            raise ValueError(f"sparse core {core!r}: the production model runs Megatron's own (dense) or linear")  # error-catalogue: internal (verify offers dense / linear only)
        from verl_ds4.mcore import sparse_attention_patch

        sparse_attention_patch.install()

    @contextlib.contextmanager
    def layout_guard_bypassed(self):
        """The zigzag control: dev's DS4 attention refuses a batch labelled zigzag; labelled contiguous, the zigzag
        rows run, and the log-probs must then differ from CP = 1."""
        ProductionLM.relabel_contiguous = True
        try:
            yield
        finally:
            ProductionLM.relabel_contiguous = False

    def min_local_rows(self, model) -> int:
        from verl_ds4.mcore.resolver import ds4_config_min_local_rows

        return int(ds4_config_min_local_rows(model.config))

    def aux_losses(self, actor) -> dict:
        """The last forward's indexer loss: Megatron's tracker (each rank's share of the CP-global loss, per layer),
        summed over layers and over the CP group (every rank calls this)."""
        import numpy as np
        from megatron.core import parallel_state
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

        values = DSAIndexerLossLoggingHelper.tracker.get("values")
        if values is None:
            return {}
        total = values.detach().sum().reshape(1).clone()
        DSAIndexerLossLoggingHelper.tracker["values"].zero_()
        if self.cp_size > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
        return {"indexer_loss": np.array([float(total)])}

