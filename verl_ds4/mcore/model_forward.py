"""verl-ds4's non-fused Megatron forward (LM head and value head), one plan per micro-batch.

:func:`gptmodel_forward_model_engine` has verl 0.9.1's signature (``verl/models/mcore/model_forward.py``)
plus a keyword ``resolved`` (the engine's :class:`~verl_ds4.mcore.resolver.ResolvedCPLayout`). It
builds **one** :class:`~verl_ds4.layout.THDPlan` from the micro-batch's input ids and packs every
per-token tensor with it: input ids, shifted labels, loss mask, temperatures, MTP labels / loss
mask, and it unpacks every per-token output (log-probs, entropy, values) with it. The layout, the
minimum rows per CP rank (DS4: ``csa_window_size``), the length bucket and the dynamic-CP group
therefore agree between the fused and non-fused LM paths, the value head and router replay.

Router replay and the dynamic-CP scheduler use :func:`pack_thd`, :func:`unpack_thd` and
:func:`refresh_dynamic_cp_padding` with the same resolved object (see :mod:`verl_ds4.engine.megatron`).

BSHD and vision models are delegated to verl's function (they do not pack THD rows themselves);
a layout they cannot honour is rejected.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from verl_ds4.layout import THDPlan
from verl_ds4.mcore import batch_plans, indexer_replay, resolver, thd
from verl_ds4.mcore.resolver import CPLayoutError, ResolvedCPLayout

_MULTI_MODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class PackedBatch:
    """One micro-batch's plan and CP context: packs and unpacks every per-token tensor alike."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        resolved: ResolvedCPLayout,
        local_cp_size: int | None = None,
        mtp_loss_normalization_factor: float | None = None,
    ):
        if not getattr(input_ids, "is_nested", False):
            raise ValueError("THD packing needs input_ids as a jagged NestedTensor [B, j].")
        cp_size, cp_rank, group, extra = thd.cp_context(local_cp_size)
        if local_cp_size is None and cp_size != resolved.cp_size:
            raise CPLayoutError(
                f"Megatron's context-parallel world size is {cp_size}, but the engine resolved its layout for "
                f"cp_size={resolved.cp_size}; initialise parallel state before resolving the layout."
            )
        self.resolved = resolved
        self.input_ids = input_ids
        self.local_cp_size = local_cp_size
        self.cp_rank = cp_rank
        self.group = group
        self.offsets = input_ids.offsets()
        # The micro-batch's one plan (shared with router replay and the dynamic-CP scheduler).
        self.plan: THDPlan = batch_plans.plan_for(input_ids, resolved.plan_options(local_cp_size), cp_group=group)
        if local_cp_size is not None:
            check_dynamic_cp_rows(self.plan, resolved, local_cp_size)
        # The resolver checked at start-up that every attention consumes this layout. The params
        # carry the plan (and verl's MTP factor) as declared fields to every consumer.
        self.packed_seq_params: thd.PlannedPackedSeqParams = thd.packed_seq_params_for(
            self.plan,
            extra,
            layout_consumer_checked=True,
            mtp_loss_normalization_factor=mtp_loss_normalization_factor,
            real_cu_seqlens=resolved.real_cu_seqlens,
        )

    def _check_same_batch(self, tensor: torch.Tensor, name: str) -> None:
        if not getattr(tensor, "is_nested", False):
            raise ValueError(f"{name}: expected a jagged NestedTensor shaped like input_ids, got a dense tensor.")
        offsets = tensor.offsets()
        if offsets is self.offsets:
            return
        # host ints first (a clear error); the lengths themselves on the device (no synchronisation)
        if int(offsets.shape[0]) != int(self.offsets.shape[0]) or batch_plans.num_tokens(tensor) != self.plan.num_tokens:
            raise ValueError(
                f"{name}: {int(offsets.shape[0]) - 1} sequences / {batch_plans.num_tokens(tensor)} tokens, but input_ids "
                f"has {self.plan.batch_size} / {self.plan.num_tokens}; it cannot share their rows."
            )
        torch._assert_async(
            torch.eq(offsets.to(self.offsets.device), self.offsets).all(),
            f"verl-ds4: {name}: its sequence lengths differ from input_ids'; it cannot share their rows.",
        )

    def pack(self, tensor: torch.Tensor, name: str = "tensor", shift: bool = False) -> torch.Tensor:
        """This rank's rows ``[1, local_rows, ...]`` of a jagged per-token tensor (``shift``: labels)."""
        self._check_same_batch(tensor, name)
        return self.plan.pack(thd.flat_values(tensor), self.cp_rank, shift=shift).unsqueeze(0)

    def position_ids(self, shift: bool = False) -> torch.Tensor:
        return self.plan.position_ids(self.cp_rank, shift=shift).unsqueeze(0)

    def unpack(self, output: torch.Tensor) -> torch.Tensor:
        """``[1, local_rows, ...]`` per-row outputs -> jagged ``[B, j, ...]``."""
        if output.dim() < 2 or output.shape[0] != 1:
            raise ValueError(f"expected per-row outputs shaped [1, local_rows, ...], got {tuple(output.shape)}")
        return self.plan.unpack(output[0], group=self.group, cp_rank=self.cp_rank)


def load_indexer_replay(batch: PackedBatch, unwrapped) -> None:
    """In a replaying micro-batch (:func:`verl_ds4.mcore.indexer_replay.pending`), hand the model's selecting
    layers the rollout's indexer choices of this rank's query rows, packed with the micro-batch's one plan
    (CP padding rows: NOT_RECORDED, chosen natively). Any other forward drops the targets a replaying one
    left (it chooses natively)."""
    replaying, replay_ids = indexer_replay.pending()
    if not replaying:
        indexer_replay.forget_targets(unwrapped)
        return
    if replay_ids is None:
        indexer_replay.refuse_missing_field()
    indexer_replay.check_shape(replay_ids, unwrapped)
    batch._check_same_batch(replay_ids, indexer_replay.FIELD)
    # the whole field, the same on every CP rank: a bad id is refused by all ranks together, before the forward
    indexer_replay.check_reach(thd.flat_values(replay_ids), replay_ids.offsets(), unwrapped)
    rows = batch.plan.pack(thd.flat_values(replay_ids), batch.cp_rank, fill=indexer_replay.NOT_RECORDED)
    indexer_replay.load(unwrapped, rows.to(batch.input_ids.device))


def untouched_by_indexer_replay(model, what: str) -> None:
    """A forward that does not pack the micro-batch (verl's ``what`` forward): refuse a replaying micro-batch
    (its layers would silently choose natively), else drop any target a replaying forward left."""
    replaying, _ = indexer_replay.pending()
    if replaying:
        raise indexer_replay.IndexerReplayError(
            f"indexer replay is on ({indexer_replay.SWITCH}=true), but this micro-batch runs verl's {what} forward, "
            f"which does not pack the rollout's {indexer_replay.FIELD!r} rows (its layers would choose natively). "
            "Replay needs THD text inputs (data_format='thd'): set actor_rollout_ref.model.use_remove_padding=true, "
            f"or {indexer_replay.SWITCH}=false."
        )
    indexer_replay.forget_targets(_unwrap(model))


def _resolved_for(model, resolved: ResolvedCPLayout | None, cp_layout: str | None, pad_to_length_bucket) -> ResolvedCPLayout:
    if resolved is None:
        resolved = resolver.resolved_for(model, pad_to_length_bucket=pad_to_length_bucket)
    if cp_layout is not None and str(cp_layout) != resolved.layout:
        raise CPLayoutError(
            f"the caller asked for cp_layout={cp_layout!r}, but the engine resolved {resolved.describe()}; "
            "the layout is decided once by verl_ds4.mcore.resolver."
        )
    if pad_to_length_bucket is not None and pad_to_length_bucket != resolved.pad_to_length_bucket:
        raise CPLayoutError(
            f"the caller asked for pad_to_length_bucket={pad_to_length_bucket}, but the engine resolved "
            f"{resolved.pad_to_length_bucket}."
        )
    return resolved


def pack_thd(
    tensor: torch.Tensor,
    resolved: ResolvedCPLayout,
    *,
    pre_process: bool = True,
    need_roll: bool = False,
    local_cp_size: int | None = None,
) -> tuple[torch.Tensor, PackedSeqParams, torch.Tensor | None]:
    """verl's ``preprocess_thd_engine`` return values for ``tensor``, packed with the resolved layout."""
    batch = PackedBatch(tensor, resolved, local_cp_size)
    if not pre_process:
        return tensor, batch.packed_seq_params, None
    rows = batch.pack(tensor, shift=need_roll)
    return rows, batch.packed_seq_params, batch.position_ids(shift=need_roll)


def unpack_thd(
    output: torch.Tensor,
    packed_seq_params: PackedSeqParams,
    input_ids: torch.Tensor,
    resolved: ResolvedCPLayout,
    *,
    post_process: bool = True,
    local_cp_size: int | None = None,
) -> torch.Tensor:
    """verl's ``postprocess_thd_engine`` with the resolved layout (``packed_seq_params`` from :func:`pack_thd`)."""
    return thd.postprocess_thd_engine(
        output,
        packed_seq_params,
        input_ids,
        input_ids.shape[0],
        post_process=post_process,
        local_cp_size=local_cp_size,
        cp_layout=resolved.layout,
    )


def check_dynamic_cp_rows(plan: THDPlan, resolved: ResolvedCPLayout, local_cp_size: int) -> None:
    """Refuse a dynamic-CP micro-batch whose ranks would hold fewer rows than the model's minimum."""
    minimum = resolved.min_local_rows
    if minimum and plan.local_rows < minimum:
        raise CPLayoutError(
            f"a dynamic-CP micro-batch of {plan.batch_size} sequences / {plan.num_tokens} tokens split over "
            f"local_cp_size={local_cp_size} ranks gives {plan.local_rows} rows per rank, but the model needs at least "
            f"{minimum} ({resolved.describe()}). Plan it with the engine's resolved layout "
            f"(ResolvedCPLayout.plan_options(local_cp_size={local_cp_size}) pads to {local_cp_size} * {minimum} rows)."
        )


def refresh_dynamic_cp_padding(micro_batch, resolved: ResolvedCPLayout, dcp_group) -> None:
    """Plan a dynamic-CP micro-batch once and derive its router padding mask from that plan.

    verl 0.9.1's scheduler derives the mask from its own padding rule; the model's rows come from
    our plan, so the mask (True on padding rows) and the local token count are computed from it,
    on the plan's device (no host transfer). The plan travels with the micro-batch
    (:data:`~verl_ds4.mcore.batch_plans.PLAN_KEY`) and the engine's forward step packs with it.
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DCP_LOCAL_NUM_TOKENS, DCP_PADDING_MASK

    local_cp_size = tu.get_non_tensor_data(micro_batch, key="local_cp_size", default=None)
    if local_cp_size is None:
        raise RuntimeError("dynamic-CP micro-batch has no local_cp_size")
    local_cp_size = int(local_cp_size)
    # Megatron's dynamic groups are aligned runs of local_cp_size consecutive DPxCP ranks.
    cp_rank = dcp_group.rank() % local_cp_size
    input_ids = micro_batch["input_ids"]
    plan = thd.make_plan(input_ids, resolved.plan_options(local_cp_size))
    check_dynamic_cp_rows(plan, resolved, local_cp_size)
    mask = plan.gather_index(cp_rank) < 0
    tu.assign_non_tensor_data(micro_batch, batch_plans.PLAN_KEY, plan)
    tu.assign_non_tensor_data(micro_batch, DCP_PADDING_MASK, mask)
    # a 0-d tensor on the plan's device: verl reads it with torch.as_tensor (no host read)
    tu.assign_non_tensor_data(micro_batch, DCP_LOCAL_NUM_TOKENS, mask.numel() - mask.sum())


def _model_kwargs(multi_modal_inputs: dict | None, device) -> dict[str, Any]:
    inputs = multi_modal_inputs or {}
    return {key: inputs[key].to(device) for key in _MULTI_MODAL_KEYS if key in inputs}


def _unwrap(model):
    from verl.utils.megatron_utils import unwrap_model

    return unwrap_model(model)


def gptmodel_forward_model_engine(
    model,
    input_ids,
    multi_modal_inputs: dict,
    logits_processor=None,
    logits_processor_args: dict | None = None,
    value_model=False,
    vision_model=False,
    pad_token_id=None,
    data_format: str = "thd",
    mtp_enable_train: bool = False,
    local_cp_size: int | None = None,
    forced_max_seqlen: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str | None = None,
    router_padding_mask: torch.Tensor | None = None,
    mtp_loss_normalization_factor: float | None = None,
    *,
    resolved: ResolvedCPLayout | None = None,
):
    """Non-fused forward of a Megatron GPT model on a jagged micro-batch (verl 0.9.1's signature).

    Returns the jagged per-token outputs: ``{name: [B, j, ...]}`` from ``logits_processor`` on the
    LM path, or ``[B, j]`` values when ``value_model``. ``resolved`` defaults to the layout registered
    for ``model`` (:func:`verl_ds4.mcore.resolver.resolved_for`: resolved once on first use).
    """
    if data_format not in ("thd", "bshd"):
        raise ValueError(f"data_format must be 'thd' or 'bshd', got {data_format!r}")
    resolved = _resolved_for(model, resolved, cp_layout, pad_to_length_bucket)
    if data_format == "bshd" or vision_model:
        return _delegate_to_verl(
            model, input_ids, multi_modal_inputs, resolved, data_format, vision_model,
            logits_processor=logits_processor, logits_processor_args=logits_processor_args,
            value_model=value_model, pad_token_id=pad_token_id, mtp_enable_train=mtp_enable_train,
            local_cp_size=local_cp_size, forced_max_seqlen=forced_max_seqlen,
            router_padding_mask=router_padding_mask, mtp_loss_normalization_factor=mtp_loss_normalization_factor,
        )  # fmt: skip

    unwrapped = _unwrap(model)
    pre_process, post_process = unwrapped.pre_process, unwrapped.post_process
    batch = PackedBatch(input_ids, resolved, local_cp_size, mtp_loss_normalization_factor)
    params = batch.packed_seq_params

    model_kwargs = _model_kwargs(multi_modal_inputs, input_ids.device)
    if pre_process or (post_process and mtp_enable_train):
        model_input = batch.pack(input_ids, "input_ids").contiguous()
    else:
        model_input = input_ids  # ignored by later pipeline stages, as in verl

    args = logits_processor_args if logits_processor_args is not None else {}
    if mtp_enable_train and post_process:
        from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested, _convert_to_nested_tensor

        lengths = batch_plans.host_seqlens(batch.plan)  # from the plan's one transfer
        label = _convert_to_nested_tensor(args["label"], lengths)
        loss_mask = _build_mtp_loss_mask_nested(args["loss_mask"], lengths, args.get("response_attention_mask"))
        args["label"], args["loss_mask"] = label, loss_mask
        model_kwargs["labels"] = batch.pack(label, "label", shift=True).contiguous()
        model_kwargs["loss_mask"] = batch.pack(loss_mask, "loss_mask", shift=True).contiguous()
    # verl's contract: the logits processor does not receive these two.
    args.pop("loss_mask", None)
    args.pop("response_attention_mask", None)
    if router_padding_mask is not None:
        model_kwargs["padding_mask"] = router_padding_mask

    load_indexer_replay(batch, unwrapped)
    output = model(
        input_ids=model_input,
        attention_mask=None,
        position_ids=batch.position_ids() if mtp_enable_train else None,
        packed_seq_params=params,
        **model_kwargs,
    )
    if not post_process:
        return output
    if logits_processor is not None:
        packed_args = {key: batch.pack(value, key, shift=(key == "label")) for key, value in args.items()}
        processed = logits_processor(output, **packed_args)
        result = {key: batch.unpack(value) for key, value in processed.items()}
    else:
        result = batch.unpack(output)
    if value_model:
        # squeeze, not [..., 0]: indexing a jagged tensor breaks its backward (as noted in verl)
        result = result.squeeze(-1)
    return result


def _delegate_to_verl(model, input_ids, multi_modal_inputs, resolved, data_format, vision_model, **kwargs):
    """BSHD and vision inputs: verl's own forward, told the resolved layout (it cannot pad to a minimum)."""
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine as verl_forward

    untouched_by_indexer_replay(model, "BSHD" if data_format == "bshd" else "vision-model")
    cp_possible = resolved.cp_size > 1 or resolved.dynamic_cp
    if data_format == "bshd" and cp_possible and resolved.layout != resolver.ZIGZAG:
        raise CPLayoutError(
            f"BSHD inputs with context parallelism are split zigzag, but this model needs {resolved.describe()}. "
            "Use THD: set model.use_remove_padding=True."
        )
    if resolved.min_local_rows and cp_possible:
        raise CPLayoutError(
            f"{'BSHD' if data_format == 'bshd' else 'vision-model'} inputs cannot be padded to "
            f"{resolved.min_local_rows} rows per CP rank ({resolved.describe()}); use THD text inputs or CP=1."
        )
    return verl_forward(
        model,
        input_ids,
        multi_modal_inputs,
        vision_model=vision_model,
        data_format=data_format,
        pad_to_length_bucket=resolved.pad_to_length_bucket,
        cp_layout=resolved.layout,
        **kwargs,
    )


__all__ = [
    "PackedBatch",
    "load_indexer_replay",
    "check_dynamic_cp_rows",
    "gptmodel_forward_model_engine",
    "pack_thd",
    "refresh_dynamic_cp_padding",
    "unpack_thd",
    "untouched_by_indexer_replay",
]
