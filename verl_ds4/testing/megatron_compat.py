"""Stand-ins for Megatron-Core features that the installed release lacks (tests and benchmarks only).

megatron-core 0.16.1 (the newest release for Python 3.11) has no ``PackedSeqParams.cp_partition_mode``;
the Megatron-LM ``dev`` branch in the GPU image has it. verl-ds4's own packing always records the
layout in the declared field of :class:`verl_ds4.mcore.thd.PlannedPackedSeqParams`, so nothing has
to be emulated for its attention modules. :func:`emulate_cp_partition_mode_field` makes both verl's
THD module and ours behave as on a Megatron-Core that has the field (verl then builds its
``PackedSeqParams`` as that declared subclass), so that the contiguous CP path of both can be
exercised and compared on CPU. Never used by library code.
"""

from __future__ import annotations


def emulate_cp_partition_mode_field(include_verl: bool = True) -> type:
    """Make verl's (unless ``include_verl`` is False) and our THD modules see a ``PackedSeqParams``
    with ``cp_partition_mode``; return that class."""
    import verl_ds4.mcore.thd as ours

    if ours.packed_seq_params_has_cp_partition_mode():
        return ours.PackedSeqParams  # a Megatron-Core that has it: nothing to emulate
    with_field = ours.PlannedPackedSeqParams
    if include_verl:
        import verl.models.mcore.util as verl_util

        verl_util.PackedSeqParams = with_field
        verl_util._PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE = True
    ours.PackedSeqParams = with_field  # "Megatron's PackedSeqParams has the field" for our start-up checks
    return with_field
