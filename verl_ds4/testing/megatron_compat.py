"""Stand-ins for Megatron-Core features that the installed release lacks (tests and benchmarks only).

megatron-core 0.16.1 (the newest release for Python 3.11) has no ``PackedSeqParams.cp_partition_mode``;
the Megatron-LM ``dev`` branch in the GPU image has it. :func:`emulate_cp_partition_mode_field`
installs a ``PackedSeqParams`` subclass with that field into verl's and our THD modules so that the
contiguous CP path of both can be exercised and compared on CPU. Never used by library code.
"""

from __future__ import annotations

import dataclasses


def emulate_cp_partition_mode_field(include_verl: bool = True) -> type:
    """Give verl's (unless ``include_verl`` is False) and our THD modules a ``PackedSeqParams`` with
    ``cp_partition_mode``; return it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import verl_ds4.mcore.thd as ours

    if "cp_partition_mode" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        return PackedSeqParams  # a Megatron-Core that has it: nothing to emulate

    @dataclasses.dataclass
    class PackedSeqParamsWithMode(PackedSeqParams):
        cp_partition_mode: str = "zigzag"

    if include_verl:
        import verl.models.mcore.util as verl_util

        verl_util.PackedSeqParams = PackedSeqParamsWithMode
        verl_util._PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE = True
    ours.PackedSeqParams = PackedSeqParamsWithMode
    return PackedSeqParamsWithMode
