"""verl-ds4's fused-kernel Megatron forward (LM head), packed with the engine's resolved layout.

:func:`fused_forward_model_engine` mirrors verl 0.9.1's factory of the same name
(``verl/models/mcore/model_forward_fused.py``): it returns the inner function verl's engine calls,
with the same keyword arguments plus ``resolved``. Input ids and shifted labels are packed from one
:class:`~verl_ds4.mcore.model_forward.PackedBatch`, so the fused path pads exactly like the
non-fused path and the value head (verl 0.9.1 applies DS4's minimum rows here only).

The model call itself (Megatron's output-processor hook on Megatron-Core >= 0.18, else verl's
patched ``GPTModel.forward``) and the fused log-prob / entropy kernel stay verl's.
"""

from __future__ import annotations

import torch

from verl_ds4.mcore.model_forward import (
    PackedBatch,
    _model_kwargs,
    _resolved_for,
    _unwrap,
    load_indexer_replay,
    untouched_by_indexer_replay,
)
from verl_ds4.mcore.resolver import CPLayoutError, ResolvedCPLayout


def _call_fused_model(model, forward_kwargs: dict, temperature: float):
    from verl.models.mcore.model_forward_fused import (
        FusedOutputProcessorContext,
        _use_output_processor_hook,
        fused_output_processor,
    )

    if _use_output_processor_hook(model):
        return model(
            **forward_kwargs,
            output_processor=fused_output_processor,
            output_processor_context=FusedOutputProcessorContext(temperature=temperature),
        )
    return model(temperature=temperature, **forward_kwargs)


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor


def fused_forward_model_engine(vision_model: bool = False):
    """Return the fused forward for jagged micro-batches (verl 0.9.1's inner signature + ``resolved``)."""

    def fused_forward_model_engine_inner(
        model,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        multi_modal_inputs: dict,
        temperature: float,
        calculate_entropy: bool,
        pad_token_id: int,
        cp_layout: str | None = None,
        local_cp_size: int | None = None,
        router_padding_mask: torch.Tensor | None = None,
        pad_to_length_bucket: int | None = None,
        *,
        resolved: ResolvedCPLayout | None = None,
    ):
        resolved = _resolved_for(model, resolved, cp_layout, pad_to_length_bucket)
        if vision_model:
            return _delegate_vision(
                model, input_ids, labels, multi_modal_inputs, temperature, calculate_entropy, pad_token_id,
                resolved, local_cp_size, router_padding_mask,
            )  # fmt: skip

        unwrapped = _unwrap(model)
        pre_process, post_process = unwrapped.pre_process, unwrapped.post_process
        batch = PackedBatch(input_ids, resolved, local_cp_size)
        model_input = batch.pack(input_ids, "input_ids").contiguous() if pre_process else input_ids
        label_rows = batch.pack(labels, "labels", shift=True).contiguous()

        forward_kwargs = dict(
            input_ids=model_input,
            attention_mask=None,
            position_ids=None,
            packed_seq_params=batch.packed_seq_params,
            labels=label_rows,
            **_model_kwargs(multi_modal_inputs, input_ids.device),
        )
        if router_padding_mask is not None:
            forward_kwargs["padding_mask"] = router_padding_mask
        load_indexer_replay(batch, unwrapped)
        output = _call_fused_model(model, forward_kwargs, temperature)
        if not post_process:
            return output

        result = {"log_probs": batch.unpack(_as_rows(output.log_probs))}
        if calculate_entropy:
            result["entropy"] = batch.unpack(_as_rows(output.entropy))
        return result

    return fused_forward_model_engine_inner


def _delegate_vision(
    model, input_ids, labels, multi_modal_inputs, temperature, calculate_entropy, pad_token_id,
    resolved: ResolvedCPLayout, local_cp_size, router_padding_mask,
):  # fmt: skip
    from verl.models.mcore.model_forward_fused import fused_forward_model_engine as verl_factory

    untouched_by_indexer_replay(model, "vision-model")  # refuses a replaying micro-batch, drops a stale target
    if resolved.min_local_rows and (resolved.cp_size > 1 or resolved.dynamic_cp):
        raise CPLayoutError(
            f"vision-model inputs cannot be padded to {resolved.min_local_rows} rows per CP rank "
            f"({resolved.describe()}); use CP=1."
        )
    return verl_factory(True)(
        model,
        input_ids,
        labels,
        multi_modal_inputs,
        temperature,
        calculate_entropy,
        pad_token_id,
        cp_layout=resolved.layout,
        local_cp_size=local_cp_size,
        router_padding_mask=router_padding_mask,
        pad_to_length_bucket=resolved.pad_to_length_bucket,
    )


__all__ = ["fused_forward_model_engine"]
