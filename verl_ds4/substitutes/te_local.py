"""TransformerEngine's modules and version gate, replaced by local (pure-PyTorch) ones for a CPU.

* The DS4 specs ask a *backend spec provider* for their modules. ``dev``'s block spec
  (``get_transformer_block_with_experimental_attention_variant_spec``, what Megatron-Bridge's DS4 provider uses)
  gets it from ``_get_backend_spec_provider``, which asserts ``transformer_impl == "transformer_engine"``; it is
  replaced by one that returns :class:`CPUSpecProvider`: Megatron's own ``LocalSpecProvider`` (its column / row
  parallel linears, torch norms, SequentialMLP experts) whose ``linear()`` is :class:`LocalLinear`.
* :class:`LocalLinear` stands in for ``TELinear(parallel_mode="duplicated")`` (the replicated linears of the DS4
  attention: ``linear_q_down_proj``, the compressor's and indexer's projections). DS4 attention accepts only
  ``TELinear`` as ``linear_q_down_proj``, so that module's ``TELinear`` name is bound to :class:`LocalLinear`, and
  Megatron-Bridge learns that it is replicated (``AutoMapping.register_module_type``).
* The MTP block: Megatron-Bridge's ``mtp_block_spec`` passes ``use_transformer_engine=True`` to
  ``get_gpt_mtp_block_spec``; that function is replaced by one that builds the same block with
  :class:`CPUSpecProvider`.
* The packing-scheduler gate: contiguous CP requires a ``sequence_packing_scheduler``, which
  ``TransformerConfig.__post_init__`` allows only with TransformerEngine >= 2.9 (a TE convergence issue). Without
  TE the version check of ``transformer_config`` answers that version as met; every other TE version check keeps
  its answer.
"""

from __future__ import annotations

import torch

from .patching import Patches

__all__ = ["CPUSpecProvider", "LocalLinear", "SCHEDULER_TE_VERSION", "install"]

#: The TransformerEngine version ``TransformerConfig`` requires for a sequence-packing scheduler.
SCHEDULER_TE_VERSION = "2.9.0"


class LocalLinear(torch.nn.Module):
    """A replicated linear (``y = x W^T``), Megatron's ``(output, bias)`` return: ``TELinear``'s duplicated mode."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, skip_bias_add=False, **_unused):
        super().__init__()
        if bias:
            raise ValueError("LocalLinear stands in for DS4's bias-free replicated linears; bias=True was asked")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = None
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None

    def backward_dw(self):  # TE's delayed weight-gradient hook: nothing is delayed here
        return None


def _flattened(cls):
    """``cls`` (Megatron's column / row parallel linear) taking inputs of any rank, as TE's linears do: leading
    dimensions are folded into one before the call and unfolded after. Megatron's own linears run a 4-D input forward
    but their weight-gradient step accepts 2-D and 3-D gradients only; DS4 attention feeds a 4-D one."""

    class Flattened(cls):
        def forward(self, input_, *args, **kwargs):
            if input_.dim() <= 3:
                return super().forward(input_, *args, **kwargs)
            lead = input_.shape[:-1]
            output, bias = super().forward(input_.reshape(-1, 1, input_.shape[-1]), *args, **kwargs)
            return output.reshape(*lead, output.shape[-1]), bias

    Flattened.__name__ = Flattened.__qualname__ = f"CPU{cls.__name__}"
    return Flattened


_CLASSES: dict = {}


def _cpu_spec_provider_class():
    if _CLASSES:
        return _CLASSES["provider"]
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    column, row = _flattened(ColumnParallelLinear), _flattened(RowParallelLinear)

    class CPUSpecProvider(LocalSpecProvider):
        """Megatron's local backend, with :class:`LocalLinear` as its replicated ``linear()`` and its column / row
        parallel linears taking inputs of any rank."""

        def linear(self):
            return LocalLinear

        def column_parallel_linear(self):
            return column

        def row_parallel_linear(self):
            return row

    _CLASSES.update(provider=CPUSpecProvider, column=column, row=row)
    return CPUSpecProvider


def CPUSpecProvider(config=None):  # noqa: N802  (a factory named after what it returns)
    """An instance of the local backend spec provider (``config`` is accepted for ``_get_backend_spec_provider``)."""
    return _cpu_spec_provider_class()()


def install(patches: Patches) -> None:
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.experimental_attention_variant import deepseek_v4_hybrid_attention

    patches.set(specs, "_get_backend_spec_provider", CPUSpecProvider)
    patches.set(deepseek_v4_hybrid_attention, "TELinear", LocalLinear)

    def get_gpt_mtp_block_spec(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None):
        return gpt_layer_specs.get_gpt_mtp_block_spec_for_backend(
            config=config, spec=spec, backend=CPUSpecProvider(config), vp_stage=vp_stage, pp_rank=pp_rank)

    patches.set(gpt_layer_specs, "get_gpt_mtp_block_spec", get_gpt_mtp_block_spec)
    original = transformer_config.is_te_min_version

    def is_te_min_version(version, *args, **kwargs):
        return True if version == SCHEDULER_TE_VERSION else original(version, *args, **kwargs)

    patches.set(transformer_config, "is_te_min_version", is_te_min_version)
    try:
        from megatron.bridge.models.conversion.param_mapping import AutoMapping
    except ImportError:  # Megatron-LM dev without the bridge: nothing to register
        return
    AutoMapping.register_module_type("LocalLinear", "replicated")
    _cpu_spec_provider_class()
    AutoMapping.register_module_type(_CLASSES["column"].__name__, "column")
    AutoMapping.register_module_type(_CLASSES["row"].__name__, "row")
