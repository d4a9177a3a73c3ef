"""Differential tests: verl_ds4.mcore.thd against the installed verl 0.9.1, rank by rank.

Each world is a set of real gloo processes with Megatron's parallel state initialised for every
(tp, cp) the world size allows; on each rank both implementations pre-process the same random
micro-batches, and both post-process (with a real all-gather) the same per-row outputs.

megatron-core 0.16.1's ``PackedSeqParams`` has no ``cp_partition_mode``, so verl 0.9.1 refuses
contiguous CP > 1. To compare that path too, the worker installs a ``PackedSeqParams`` subclass
with the field into both modules: a stand-in for the newer Megatron-Core the GPU image carries.
"""

from __future__ import annotations

import dataclasses
import math
import random

from types import SimpleNamespace

import pytest
import torch

from verl_ds4.layout import CPLayout
from verl_ds4.mcore.distributed import run_distributed
from verl_ds4.testing.megatron_compat import emulate_cp_partition_mode_field

CASES_PER_CONFIG = 24


def _random_lengths(rng: random.Random) -> list[int]:
    batch = rng.randint(1, 10)
    kinds = [lambda: 1, lambda: rng.randint(1, 8), lambda: rng.randint(9, 120), lambda: rng.randint(120, 400)]
    return [rng.choice(kinds)() for _ in range(batch)]


def _nested(lengths: list[int], trailing: tuple[int, ...], gen: torch.Generator, floating: bool = False):
    total = sum(lengths)
    if floating:
        values = torch.randn(total, *trailing, generator=gen, dtype=torch.float64)
    else:
        values = torch.randint(1, 50_000, (total, *trailing), generator=gen)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


PSP_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "local_cp_size",
    "cp_partition_mode",
)


def _assert_same_params(ref, got, where):
    for name in PSP_FIELDS:
        a, b = getattr(ref, name, None), getattr(got, name, None)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where}: {name} {a} != {b}"
        else:
            assert a == b, f"{where}: {name} {a!r} != {b!r}"


def _compare_config(tp: int, cp: int, seed: int, stats: dict) -> None:
    """Run CASES_PER_CONFIG random cases under the current parallel state."""
    import verl.models.mcore.util as verl_util
    from megatron.core import parallel_state as mpu

    import verl_ds4.mcore.thd as ours

    cp_rank = mpu.get_context_parallel_rank()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for case in range(CASES_PER_CONFIG):
        lengths = _random_lengths(rng)
        layout = rng.choice(["zigzag", "contiguous"])
        need_roll = rng.random() < 0.5
        trailing = rng.choice([(), (), (3,)])
        min_local_rows = rng.choice([None, None, rng.randint(1, 64), 128])
        bucket = rng.choice([None, None, rng.randint(1, 40), 2 * tp * cp * rng.randint(1, 8)])
        fp8 = rng.random() < 0.15
        x = _nested(lengths, trailing, gen)
        kwargs = dict(
            need_roll=need_roll,
            use_fp8_padding=fp8,
            min_local_rows=min_local_rows,
            pad_to_length_bucket=bucket,
            cp_layout=layout,
        )
        where = f"tp={tp} cp={cp} rank={cp_rank} case={case} lengths={lengths} {kwargs} trailing={trailing}"
        rows, params, positions = ours.preprocess_thd_engine(x, **kwargs)
        plan = params.plan
        unit = plan.options.sequence_alignment
        # Our result is always a valid layout: every rank owns total/cp rows, sequences aligned.
        padded = params.cu_seqlens_q_padded.diff()
        assert int(params.cu_seqlens_q_padded[-1]) % (cp * tp) == 0, where
        assert bool((padded % unit == 0).all()), where
        if min_local_rows is not None:
            assert rows.shape[1] >= min_local_rows, where
        try:
            ref_rows, ref_params, ref_positions = verl_util.preprocess_thd_engine(x, **kwargs)
        except RuntimeError:
            stats["verl_crashed"] += 1  # documented difference 3: verl's bucket alignment ignores zigzag
            assert layout == "zigzag" and bucket is not None, f"verl crashed unexpectedly: {where}"
            continue
        ref_padded = ref_params.cu_seqlens_q_padded.diff()
        if bool((ref_padded % unit != 0).any()) or int(ref_params.cu_seqlens_q_padded[-1]) % (cp * tp):
            # documented difference 3: verl's tail padding broke the layout's alignment
            stats["verl_misaligned"] += 1
            assert bucket is not None or min_local_rows is not None, where
            continue
        _assert_same_params(ref_params, params, where)
        assert rows.shape == ref_rows.shape and rows.dtype == ref_rows.dtype, where
        if need_roll:
            # documented difference 1: the last real row of each sequence wraps to its first token
            # (and for zigzag, verl puts that token on the sequence's last padding row instead).
            info = plan.rank_rows(cp_rank)
            slot, pos, valid = info.slot, info.position, info.valid
            last_real = valid & (pos == info.seqlen - 1)
            differs = last_real | (~valid & (pos == plan.seqlens_padded.index_select(0, slot) - 1))
            keep = ~differs
            assert torch.equal(rows[0][keep], ref_rows[0][keep]), where
            firsts = x.values()[plan.token_offsets[:-1]].index_select(0, slot[last_real])
            assert torch.equal(rows[0][last_real], firsts), where
            stats["rows_compared"] += int(keep.sum())
            if layout == "contiguous":
                assert torch.equal(positions, ref_positions), where
        else:
            assert torch.equal(rows, ref_rows), where
            assert torch.equal(positions, ref_positions), where
            stats["rows_compared"] += rows.shape[1]
        stats["cases_equal"] += 1

        # Post-processing: the same per-row outputs through both, with a real all-gather.
        out = _nested(lengths, trailing, gen, floating=True) if not need_roll else None
        if out is None:
            continue
        local, _, _ = ours.preprocess_thd_engine(out, **{**kwargs, "need_roll": False})
        local_ours = local.clone().requires_grad_(True)
        local_ref = local.clone().requires_grad_(True)
        got = ours.postprocess_thd_engine(local_ours, params, out, len(lengths), cp_layout=layout)
        ref = verl_util.postprocess_thd_engine(local_ref, ref_params, out, len(lengths), cp_layout=layout)
        assert torch.equal(got.values(), ref.values()), where
        assert torch.equal(got.offsets(), ref.offsets()), where
        assert torch.equal(got.values(), out.values()), f"round trip lost data: {where}"
        weights = torch.randn(got.values().shape, generator=torch.Generator().manual_seed(case), dtype=torch.float64)
        (got.values() * weights).sum().backward()
        (ref.values() * weights).sum().backward()
        assert torch.equal(local_ours.grad, local_ref.grad), where
        stats["postprocess_equal"] += 1


def _world(rank: int, world_size: int, configs: list[tuple[int, int]], emulate_field: bool) -> dict:
    from megatron.core import parallel_state as mpu

    if emulate_field:
        emulate_cp_partition_mode_field()
    stats = dict(cases_equal=0, rows_compared=0, postprocess_equal=0, verl_crashed=0, verl_misaligned=0)
    for tp, cp in configs:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            # Same seed on every rank of the CP group: the same micro-batch everywhere.
            _compare_config(tp, cp, seed=1000 * tp + cp, stats=stats)
        finally:
            mpu.destroy_model_parallel()
    return stats


@pytest.mark.parametrize(
    "world_size,configs",
    [
        # 7 (tp, cp) meshes, ~25 s: ``slow``, so lane 2 (tests/conftest.py) leaves it to lane 1
        pytest.param(8, [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8)], marks=pytest.mark.slow),
        (6, [(1, 3), (2, 3)]),
        (16, [(2, 8)]),
    ],
    ids=["world8", "world6", "world16"],
)
def test_matches_verl_on_random_batches(world_size, configs):
    stats = run_distributed(_world, world_size, args=(configs, True), timeout=600)
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    # The comparison must actually have happened, on most cases, post-processing included.
    assert total["cases_equal"] >= world_size * len(configs) * CASES_PER_CONFIG // 2, total
    assert total["postprocess_equal"] > 0 and total["rows_compared"] > 0, total


def _old_megatron_world(rank: int, world_size: int) -> str:
    """With a released megatron-core's PackedSeqParams (0.16.1, 0.19.2: no cp_partition_mode): contiguous
    CP>1 is refused up front."""
    from megatron.core import parallel_state as mpu

    import verl_ds4.mcore.thd as ours

    mpu.initialize_model_parallel(context_parallel_size=2)
    x = _nested([5, 7], (), torch.Generator().manual_seed(0))
    calls = []
    original = ours.make_plan
    ours.make_plan = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with pytest.raises(ValueError, match="cp_partition_mode"):
            ours.preprocess_thd_engine(x, cp_layout="contiguous")
        assert not calls, "the layout check must run before any packing work"
        rows, params, _ = ours.preprocess_thd_engine(x, cp_layout="zigzag")
        assert params.cp_partition_mode == "zigzag"  # recorded in the declared field for our modules
        assert isinstance(params, ours.PlannedPackedSeqParams) and "cp_partition_mode" in {
            f.name for f in dataclasses.fields(params)
        }
        assert "cp_partition_mode" not in params.__dict__.keys() - {f.name for f in dataclasses.fields(params)}
        plan = ours.make_plan(x, ours.PlanOptions(layout="contiguous", cp_size=2))
        params = ours.packed_seq_params_for(plan, layout_consumer_checked=True)
        assert params.cp_partition_mode == "contiguous"
        if any(hasattr(mpu, name) for name in ours.DYNAMIC_CP_GROUP_GETTERS):
            # megatron-core 0.19.2 (lane 2) has dynamic CP groups (its "hybrid" DPxCP groups): the
            # size-2 group here is the DPxCP group, and the micro-batch is packed for it.
            _, params, _ = ours.preprocess_thd_engine(x, local_cp_size=2)
            dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
            assert params.local_cp_size == 2 and params.cp_group is dp_cp_group
        else:  # megatron-core 0.16.1 (lane 1): none, and a clear error says so
            with pytest.raises(ValueError, match="dynamic"):
                ours.preprocess_thd_engine(x, local_cp_size=2)
    finally:
        ours.make_plan = original
        mpu.destroy_model_parallel()
    return "ok"


def test_contiguous_refused_up_front_without_cp_partition_mode():
    assert run_distributed(_old_megatron_world, 2) == ["ok", "ok"]


def test_bucket_verl_crashes_on_is_aligned_here():
    """verl 0.9.1 aligns pad_to_length_bucket to cp only; zigzag then needs 2*tp*cp."""
    from verl_ds4.layout import PlanOptions, build_plan

    for tp, cp, bucket in [(1, 2, 7), (1, 2, 14), (2, 2, 6)]:
        for lengths in ([5, 9, 30], [31], [2, 2, 2, 2, 2, 2, 2, 2]):
            plan = build_plan(lengths, PlanOptions("zigzag", tp_size=tp, cp_size=cp, pad_to_length_bucket=bucket))
            assert plan.total_rows % math.lcm(bucket, 2 * tp * cp) == 0
            assert bool((plan.seqlens_padded % (2 * tp * cp) == 0).all())
            assert plan.layout is CPLayout.ZIGZAG


def test_postprocess_uses_the_carried_plan_and_refuses_another_batch():
    """A balanced (reordered) buffer cannot be recovered from cu_seqlens: the plan travels with the
    params, a copy of the micro-batch works, and a different micro-batch is refused, never misaligned."""
    from verl_ds4.layout import PlanOptions, build_plan
    from verl_ds4.mcore import thd

    gen = torch.Generator().manual_seed(3)
    x = _nested([30, 5, 200, 7], (), gen)
    plan = build_plan(x.offsets().diff(), PlanOptions("contiguous", cp_size=2), order=[2, 0, 3, 1])
    params = thd.packed_seq_params_for(plan, layout_consumer_checked=True)
    assert params.plan is plan and not hasattr(plan, "source_offsets")
    assert thd.plan_of(params, x, CPLayout.CONTIGUOUS, 2) is plan
    # A copy (new offsets object, e.g. after .to() / TensorDict slicing) is the same micro-batch.
    copy = torch.nested.nested_tensor_from_jagged(x.values().clone(), offsets=x.offsets().clone())
    assert thd.plan_of(params, copy, CPLayout.CONTIGUOUS, 2) is plan
    assert thd.plan_of(dataclasses.replace(params), copy, CPLayout.CONTIGUOUS, 2) is plan  # a replaced params too
    for other, layout, cp in (
        (_nested([30, 5, 200], (), gen), CPLayout.CONTIGUOUS, 2),  # another batch size
        (_nested([30, 5, 201, 7], (), gen), CPLayout.CONTIGUOUS, 2),  # another token count
        (x, CPLayout.ZIGZAG, 2),  # another layout
        (x, CPLayout.CONTIGUOUS, 4),  # another CP size
    ):
        with pytest.raises(ValueError, match="carries the plan of a micro-batch of 4 sequences / 242 tokens"):
            thd.plan_of(params, other, layout, cp)
    # verl's own PackedSeqParams (no plan): rebuilt from cu_seqlens, as before.
    unordered = build_plan(x.offsets().diff(), PlanOptions("contiguous", cp_size=2))
    plain = thd.PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=unordered.cu_seqlens_padded)
    rebuilt = thd.plan_of(plain, x, CPLayout.CONTIGUOUS, 2)
    assert rebuilt is not unordered and torch.equal(rebuilt.cu_seqlens_padded, unordered.cu_seqlens_padded)


def test_mtp_loss_factor_is_a_declared_field_verls_mtp_patch_reads():
    from verl.models.mcore import mtp_patch

    from verl_ds4.layout import PlanOptions, build_plan
    from verl_ds4.mcore import thd

    assert thd.MTP_LOSS_NORMALIZATION_FIELD == mtp_patch._MTP_LOSS_NORMALIZATION_FACTOR_ATTR
    assert thd.MTP_LOSS_NORMALIZATION_FIELD in {f.name for f in dataclasses.fields(thd.PlannedPackedSeqParams)}
    plan = build_plan([3, 4], PlanOptions("zigzag"))
    config = SimpleNamespace(calculate_per_token_loss=True, mtp_loss_scaling_factor=0.5)
    params = thd.packed_seq_params_for(plan, mtp_loss_normalization_factor=4.0)
    assert mtp_patch._get_mtp_loss_config(config, params).mtp_loss_scaling_factor == 2.0
    # Negative control: without the factor verl's patch leaves the config alone.
    assert mtp_patch._get_mtp_loss_config(config, thd.packed_seq_params_for(plan)) is config
