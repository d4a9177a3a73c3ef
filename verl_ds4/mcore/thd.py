"""THD pre/post-processing for Megatron-Core, built on :mod:`verl_ds4.layout`.

:func:`preprocess_thd_engine` and :func:`postprocess_thd_engine` are drop-ins for verl 0.9.1's
functions of the same names (``verl/models/mcore/util.py``): same signatures, same return types,
and identical tensors (packed rows, position ids, every ``PackedSeqParams`` field, reassembled
outputs) on every input where verl 0.9.1 works, computed without a Python loop over sequences.
Our own forward functions use the lower-level :func:`make_plan`, :func:`pack_input` and
:func:`packed_seq_params_for` to pack every per-token tensor of a micro-batch from one plan.

Deliberate differences from verl 0.9.1:

1. Label shift (``need_roll=True``) wraps inside each sequence: the last real token's label is the
   sequence's first token, on every layout and CP size. verl 0.9.1 gives, on that one row per
   sequence, the next buffer row with zigzag at CP=1 (the next sequence's first token when a
   sequence needs no padding: a label leaking across the packed boundary) or a padding zero with
   zigzag at CP>1 when the sequence is padded (and the first token on its last padding row).
   The row is masked by the loss mask in verl's recipes, so losses do not change.
2. With zigzag and ``need_roll=True`` the returned position ids are those of the label tokens,
   as verl returns for contiguous; verl's zigzag positions there are partly unshifted. Every caller
   in verl discards the position ids of the label call.
3. Extra tail padding (``pad_to_length_bucket``, ``min_local_rows``) is rounded to the layout's
   per-sequence alignment (``2*tp*cp`` for zigzag, ``tp*cp`` for contiguous). verl 0.9.1 aligns
   the bucket to ``cp`` only: zigzag with a bucket that is not a multiple of ``2*tp*cp`` then
   crashes with a shape error or silently drops tokens, and contiguous with ``tp>1`` gets an odd
   number of rows per rank. Where verl's result is already aligned, the two agree.
4. Contiguous with CP>1 on a Megatron-Core whose ``PackedSeqParams`` lacks ``cp_partition_mode``
   raises the same ``ValueError`` as verl, but before any packing work. The layout is always
   recorded as ``packed_seq_params.cp_partition_mode`` (a declared field of
   :class:`PlannedPackedSeqParams` when Megatron's lacks it) so our own attention modules can read
   it; :func:`packed_seq_params_for` with ``layout_consumer_checked=True`` (the engine's start-up
   check passed) allows it.
5. Dynamic CP on a Megatron-Core without dynamic CP groups raises a clear error (verl raises
   ``AttributeError``); megatron-core 0.19's name for them (``get_hybrid_data_context_parallel_groups``)
   is used where Megatron-LM dev's (``get_dynamic_data_context_parallel_groups``) is missing.
6. The returned ``PackedSeqParams`` is a :class:`PlannedPackedSeqParams` whose ``plan`` field
   carries the micro-batch's plan to every consumer (post-processing, router replay), so it is
   never rebuilt. Post-processing checks that it got a micro-batch of the plan's shape (batch size
   and token count, host ints: no device synchronisation) and raises otherwise; any copy of the
   micro-batch works. A plain ``PackedSeqParams`` (verl's own) is rebuilt from its ``cu_seqlens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

import torch
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams

from verl_ds4.layout import CPLayout, PlanOptions, THDPlan, plan_from_offsets
from verl_ds4.layout.plan import plan_from_padded_lengths

#: The ``PackedSeqParams`` attribute verl 0.9.1's MTP patch reads the loss normalisation factor from
#: (``verl/models/mcore/mtp_patch.py``); a declared field of :class:`PlannedPackedSeqParams`.
MTP_LOSS_NORMALIZATION_FIELD = "_verl_mtp_loss_normalization_factor"


#: Megatron-Core's getter of the DPxCP sub-group of a dynamic-CP micro-batch, by release: Megatron-LM
#: ``dev`` (what verl 0.9.1 calls) names it "dynamic"; megatron-core 0.19.x names the same feature
#: "hybrid context parallel" (``parallel_state.get_hybrid_data_context_parallel_groups``, same
#: ``group_size`` keyword). The first one the installed Megatron-Core has is used.
DYNAMIC_CP_GROUP_GETTERS = ("get_dynamic_data_context_parallel_groups", "get_hybrid_data_context_parallel_groups")


def _has_cp_partition_mode(cls) -> bool:
    return is_dataclass(cls) and "cp_partition_mode" in {f.name for f in fields(cls)}


def packed_seq_params_has_cp_partition_mode() -> bool:
    """Whether the installed Megatron-Core's ``PackedSeqParams`` has a ``cp_partition_mode`` field
    (i.e. Megatron's own attention can be told the CP split)."""
    return _has_cp_partition_mode(PackedSeqParams)


@dataclass
class PlannedPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` plus what verl-ds4's consumers read, as declared fields.

    * ``cp_partition_mode``: Megatron's field where the installed Megatron-Core has it, declared
      here where it does not (megatron-core 0.16.1), so the layout is always recorded.
    * ``plan``: the :class:`~verl_ds4.layout.THDPlan` the rows were packed with; post-processing,
      the value head and router replay unpack with it.
    * ``_verl_mtp_loss_normalization_factor``: read by verl 0.9.1's MTP patch
      (:data:`MTP_LOSS_NORMALIZATION_FIELD`).
    """

    if not _has_cp_partition_mode(PackedSeqParams):
        cp_partition_mode: str | None = None
    plan: THDPlan | None = field(default=None, repr=False, compare=False)
    _verl_mtp_loss_normalization_factor: float | None = None


def cp_context(local_cp_size: int | None):
    """``(cp_size, cp_rank, cp_group, extra PackedSeqParams kwargs)`` of the caller.

    With ``local_cp_size`` (dynamic CP) the group is Megatron's dynamic data-context-parallel group
    of that size; otherwise the static CP group of the parallel state.
    """
    if local_cp_size is None:
        return mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(), _static_cp_group(), {}
    get_groups = next((getattr(mpu, name) for name in DYNAMIC_CP_GROUP_GETTERS if hasattr(mpu, name)), None)
    if get_groups is None:
        raise ValueError(
            f"local_cp_size={local_cp_size} asks for dynamic context parallelism, but the installed "
            "Megatron-Core has no dynamic CP groups (parallel_state."
            f"{' / '.join(DYNAMIC_CP_GROUP_GETTERS)}). Install a Megatron-Core with dynamic CP or disable dynamic CP."
        )
    group = get_groups(group_size=local_cp_size)
    rank = torch.distributed.get_rank(group=group)
    return local_cp_size, rank, group, {"local_cp_size": local_cp_size, "cp_group": group}


def _static_cp_group():
    if mpu.get_context_parallel_world_size() == 1:
        return None
    return mpu.get_context_parallel_group()


def check_layout_consumable(layout: CPLayout, cp_size: int, layout_consumer_checked: bool = False) -> None:
    """Refuse to hand contiguous rows to attention that would read them as zigzag."""
    if layout is CPLayout.ZIGZAG or cp_size <= 1 or layout_consumer_checked:
        return
    from verl_ds4.mcore import megatron_api

    if not packed_seq_params_has_cp_partition_mode() and not megatron_api.installed_api().can_tell_attention:
        raise ValueError(
            f"cp_layout='{layout}' requires PackedSeqParams.cp_partition_mode, which this "
            "Megatron-core version does not provide (nor Megatron-LM main's TransformerConfig.attention_cp_layout). "
            "Upgrade Megatron-core or use the zigzag layout."
        )


def make_plan(input_ids: torch.Tensor, options: PlanOptions, cp_group=None) -> THDPlan:
    """Plan a jagged ``[B, j, ...]`` micro-batch (reads only its offsets).

    ``cp_group``: the micro-batch's CP process group; with a balanced order the ranks check over it
    that they computed the same order (one small all-reduce, see :func:`verl_ds4.layout.build_plan`).
    """
    return plan_from_offsets(input_ids.offsets(), options, cp_group=cp_group)


def packed_seq_params_for(
    plan: THDPlan,
    extra: dict | None = None,
    layout_consumer_checked: bool = False,
    mtp_loss_normalization_factor: float | None = None,
    real_cu_seqlens: bool = False,
) -> PlannedPackedSeqParams:
    """The THD ``PackedSeqParams`` of a plan, with the layout recorded and the plan carried.

    Field values match verl 0.9.1: every ``cu_seqlens*`` field is the global padded one. ``real_cu_seqlens``:
    ``cu_seqlens_q`` / ``cu_seqlens_kv`` are the real lengths instead (Megatron's convention for padded THD; the
    ``*_padded`` fields and ``max_seqlen_*`` stay the padded ones). Megatron-LM dev's DS4 needs it: its CSA indexer
    loss takes every row inside ``cu_seqlens_q`` as a real query (a padding row sees the real keys before it) and,
    unfused, divides by ``cu_seqlens_q[-1]``; with the padded lengths the loss moves with the layout's padding, so
    CP 2 gave another indexer loss than CP 1 (2.5e-3 relative on the parity batch; 0 with the real lengths).
    """
    check_layout_consumable(plan.layout, plan.cp_size, layout_consumer_checked)
    cu = plan.cu_seqlens_padded
    cu_real = plan.cu_seqlens if real_cu_seqlens else cu
    return PlannedPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        max_seqlen_q=plan.max_seqlen_padded,
        cu_seqlens_kv=cu_real,
        max_seqlen_kv=plan.max_seqlen_padded,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        cp_partition_mode=plan.layout.value,
        plan=plan,
        _verl_mtp_loss_normalization_factor=mtp_loss_normalization_factor,
        **dict(extra or {}),
    )


def flat_values(nested: torch.Tensor) -> torch.Tensor:
    """``nested.values()`` of a jagged tensor; for integer or bool data (ids, masks: never a
    gradient), its values buffer directly: the tensor ``values()`` views, without the ~20-60 us
    subclass dispatch."""
    buffer = getattr(nested, "_values", None)
    if isinstance(buffer, torch.Tensor) and not (buffer.is_floating_point() or buffer.is_complex()):
        return buffer
    return nested.values()


def pack_input(input_ids: torch.Tensor, plan: THDPlan, cp_rank: int, need_roll: bool = False):
    """``(rows [1, local_rows, ...], position_ids [1, local_rows])`` of a jagged per-token tensor."""
    values = flat_values(input_ids)
    rows = plan.pack(values, cp_rank, shift=need_roll)
    positions = plan.position_ids(cp_rank, shift=need_roll)
    return rows.unsqueeze(0), positions.unsqueeze(0)


def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
) -> tuple[torch.Tensor, PackedSeqParams, torch.Tensor | None]:
    """Pack a jagged THD micro-batch and keep this CP rank's rows (verl 0.9.1's signature).

    Returns ``(rows [1, local_rows, ...], packed_seq_params, position_ids [1, local_rows])``, or
    ``(input_ids, packed_seq_params, None)`` when ``pre_process`` is False.
    """
    layout = CPLayout.parse(cp_layout)
    cp_size, cp_rank, _, extra = cp_context(local_cp_size)
    check_layout_consumable(layout, cp_size)
    options = PlanOptions(
        layout=layout,
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_size=cp_size,
        min_local_rows=min_local_rows,
        pad_to_length_bucket=pad_to_length_bucket,
        fp8_padding=use_fp8_padding,
    )
    plan = make_plan(input_ids, options)
    params = packed_seq_params_for(plan, extra)
    if not pre_process:
        return input_ids, params, None
    rows, positions = pack_input(input_ids, plan, cp_rank, need_roll=need_roll)
    return rows, params, positions


def plan_of(packed_seq_params: PackedSeqParams, input_ids: torch.Tensor, layout: CPLayout, cp_size: int) -> THDPlan:
    """The plan behind ``packed_seq_params`` for ``input_ids``: the one it carries, or rebuilt from its fields.

    A carried plan is checked against ``input_ids`` with host ints only (batch size, token count,
    layout, CP size); a mismatch raises instead of unpacking rows of another micro-batch.
    """
    plan = packed_seq_params.plan if isinstance(packed_seq_params, PlannedPackedSeqParams) else None
    if plan is not None:
        batch, tokens = int(input_ids.shape[0]), int(flat_values(input_ids).shape[0])
        if (batch, tokens) != (plan.batch_size, plan.num_tokens) or plan.layout is not layout or plan.cp_size != cp_size:
            raise ValueError(
                f"packed_seq_params carries the plan of a micro-batch of {plan.batch_size} sequences / {plan.num_tokens} "
                f"tokens ({plan.layout} layout, cp={plan.cp_size}), but post-processing got {batch} sequences / "
                f"{tokens} tokens ({layout} layout, cp={cp_size}). Post-process with the micro-batch (or a copy of it) "
                "and the layout the rows were packed with."
            )
        return plan
    padded = packed_seq_params.cu_seqlens_q_padded.long().diff()
    return plan_from_padded_lengths(input_ids.offsets().diff(), padded, layout, cp_size)


def postprocess_thd_engine(
    output: torch.Tensor,
    packed_seq_params: PackedSeqParams,
    input_ids: torch.Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str = "zigzag",
) -> torch.Tensor:
    """Gather ``output [1, local_rows, ...]`` over CP and unpack it to a jagged ``[B, j, ...]`` tensor.

    verl 0.9.1's signature; sequences come back in original order, padding rows dropped, and the
    gradient flows through this rank's rows.
    """
    layout = CPLayout.parse(cp_layout)
    if not post_process:
        return output
    if local_cp_size is not None:
        cp_size = local_cp_size
        group = packed_seq_params.cp_group
        cp_rank = torch.distributed.get_rank(group=group)
    else:
        cp_size, cp_rank, group = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(), None
        if cp_size > 1:
            group = mpu.get_context_parallel_group()
    if input_ids.shape[0] != batch_size:
        raise ValueError(f"batch_size={batch_size} does not match input_ids with {input_ids.shape[0]} sequences.")
    plan = plan_of(packed_seq_params, input_ids, layout, cp_size)
    return plan.unpack(output[0], group=group, cp_rank=cp_rank)
