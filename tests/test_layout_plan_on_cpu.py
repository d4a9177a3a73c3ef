"""Properties of the layout core (verl_ds4.layout) and one test per layout failure mode that
others shipped (docs/ds4-context-parallel.md, section 5). Ranks are simulated in-process where only the plan is
under test; the all-gather paths run on real gloo processes."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from verl_ds4.layout import CPLayout, PlanOptions, build_plan, plan_from_offsets
from verl_ds4.mcore.distributed import run_distributed


def _flat(lengths, trailing=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 10_000, (sum(lengths), *trailing), generator=gen)


def _simulate_all_ranks(plan, values, shift=False):
    """Pack every rank and concatenate in rank order (what an all-gather returns)."""
    return torch.cat([plan.pack(values, r, shift=shift, fill=-1) for r in range(plan.cp_size)])


def _sequence_of_token(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# ---------------------------------------------------------------------------- basic contract
def test_unknown_layout_names_the_valid_ones():
    with pytest.raises(ValueError, match="'zigzag', 'contiguous'"):
        CPLayout.parse("ring")
    with pytest.raises(ValueError, match="zigzag"):
        PlanOptions(layout="contigous")
    assert CPLayout.parse(" Contiguous ") is CPLayout.CONTIGUOUS
    assert CPLayout.CONTIGUOUS == "contiguous" and str(CPLayout.ZIGZAG) == "zigzag"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(cp_size=0), "cp_size"),
        (dict(tp_size=-1), "tp_size"),
        (dict(pad_to_length_bucket=0), "pad_to_length_bucket"),
        (dict(min_local_rows=-4), "min_local_rows"),
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanOptions(**kwargs)


def test_bad_lengths_and_orders_are_rejected():
    opts = PlanOptions("contiguous", cp_size=2)
    with pytest.raises(ValueError, match="empty"):
        build_plan([], opts)
    with pytest.raises(ValueError, match="non-negative"):
        build_plan([3, -1], opts)
    with pytest.raises(ValueError, match="permutation"):
        build_plan([3, 4, 5], opts, order=[0, 0, 1])
    plan = build_plan([3, 4], opts)
    with pytest.raises(ValueError, match="flat per-token tensor with 7 rows"):
        plan.pack(torch.zeros(6), 0)
    with pytest.raises(ValueError, match="cp_rank"):
        plan.pack(torch.zeros(7), 2)


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_token_lands_on_exactly_one_rank_and_comes_back(layout, cp, tp):
    rng = random.Random(17 * cp + tp)
    for trial in range(12):
        lengths = [rng.choice([1, 2, rng.randint(1, 50), rng.randint(50, 300)]) for _ in range(rng.randint(1, 9))]
        order = rng.sample(range(len(lengths)), len(lengths)) if layout == "contiguous" and trial % 2 else None
        opts = PlanOptions(
            layout,
            tp_size=tp,
            cp_size=cp,
            min_local_rows=rng.choice([None, 1, 33, 128]),
            pad_to_length_bucket=rng.choice([None, 5, 7, 64]),
            fp8_padding=trial % 5 == 4,
        )
        plan = build_plan(lengths, opts, order=order)
        values = _flat(lengths, trailing=(2,), seed=trial)
        gathered = _simulate_all_ranks(plan, values)
        # Equal shards, tp-splittable, the minimum honoured.
        assert plan.total_rows == plan.local_rows * cp and plan.local_rows % tp == 0
        assert plan.local_rows >= (opts.min_local_rows or 0)
        if opts.pad_to_length_bucket:
            assert plan.total_rows % opts.pad_to_length_bucket == 0
        # Each token exactly once; padding rows are the fill value.
        index = torch.cat([plan.gather_index(r) for r in range(cp)])
        real = index[index >= 0]
        assert torch.equal(real.sort().values, torch.arange(sum(lengths)))
        assert bool((gathered[index < 0] == -1).all())
        # Unpack (the all-gather simulated by the concatenation) restores the original order.
        assert torch.equal(gathered.index_select(0, plan.token_rows()), values)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_label_shift_stays_inside_each_sequence(layout):
    """Failure mode: a label roll leaking across packed sequence boundaries."""
    lengths = [4, 1, 6, 3]  # with zigzag cp=1 and no padding, a global roll would leak
    values = torch.arange(1, sum(lengths) + 1)
    seq_of = _sequence_of_token(lengths)
    for cp in (1, 2, 4):
        plan = build_plan(lengths, PlanOptions(layout, cp_size=cp))
        for r in range(cp):
            src = plan.gather_index(r)
            label_src = plan.gather_index(r, shift=True)
            valid = src >= 0
            assert torch.equal(seq_of[src[valid]], seq_of[label_src[valid]]), "label taken from another sequence"
            pos = plan.position_ids(r)[valid]
            nxt = plan.position_ids(r, shift=True)[valid]
            lens = torch.tensor(lengths)[seq_of[src[valid]]]
            assert torch.equal(nxt, (pos + 1) % lens)
            labels = plan.pack(values, r, shift=True)
            assert torch.equal(labels[valid], values[label_src[valid]])


def _verl_cp1_roll(rank, world):
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import preprocess_thd_engine as verl_pre

    from verl_ds4.mcore.thd import preprocess_thd_engine as ours_pre

    mpu.initialize_model_parallel()
    # Two sequences already aligned (tp=cp=1): no padding row between them.
    x = torch.nested.nested_tensor_from_jagged(torch.arange(1, 9), offsets=torch.tensor([0, 4, 8]))
    ref, _, _ = verl_pre(x, need_roll=True)
    got, _, _ = ours_pre(x, need_roll=True)
    mpu.destroy_model_parallel()
    return ref[0].tolist(), got[0].tolist()


def test_verl_zigzag_cp1_roll_leaks_but_ours_does_not():
    """The regression behind the test above, shown on verl 0.9.1 itself."""
    [(ref, got)] = run_distributed(_verl_cp1_roll, 1)
    assert ref[3] == 5, "verl 0.9.1 labels seq 0's last token with seq 1's first token"
    assert got[3] == 1 and got[7] == 5
    assert [ref[i] for i in (0, 1, 2, 4, 5, 6)] == [got[i] for i in (0, 1, 2, 4, 5, 6)]


def test_contiguous_ranks_own_one_interval_of_the_global_buffer():
    """DS4 contract: rank r owns global rows [r*L, (r+1)*L); sequences may straddle ranks."""
    lengths = [300, 5, 129, 1, 77]
    plan = build_plan(lengths, PlanOptions("contiguous", cp_size=4, min_local_rows=128))
    starts = plan.cu_seqlens_padded.long()
    for r in range(4):
        g0 = plan.global_start(r)
        assert g0 == r * plan.local_rows
        rows = torch.arange(g0, g0 + plan.local_rows)
        seq = torch.searchsorted(starts[1:], rows, right=True)
        assert torch.equal(plan.position_ids(r)[plan.gather_index(r) >= 0], (rows - starts[seq])[plan.gather_index(r) >= 0])
    straddling = [i for i in range(len(lengths)) if starts[i] // plan.local_rows != (starts[i + 1] - 1) // plan.local_rows]
    assert straddling, "the batch should have a sequence straddling a rank boundary"
    zig = build_plan(lengths, PlanOptions("zigzag", cp_size=4))
    with pytest.raises(ValueError, match="contiguous layout only"):
        zig.global_start(1)


def test_reassembly_in_the_wrong_layout_order_misaligns():
    """Failure mode: contiguous shards reassembled in zigzag order (misaligned log-probs)."""
    lengths = [40, 24, 56]
    values = _flat(lengths)
    contiguous = build_plan(lengths, PlanOptions("contiguous", cp_size=4))
    zigzag = build_plan(lengths, PlanOptions("zigzag", cp_size=4))
    assert contiguous.total_rows == zigzag.total_rows  # same shapes: nothing would crash
    gathered = _simulate_all_ranks(contiguous, values)
    assert torch.equal(gathered.index_select(0, contiguous.token_rows()), values)
    assert not torch.equal(gathered.index_select(0, zigzag.token_rows()), values)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_short_sequences_under_large_cp(layout):
    """Failure mode: 1-token sequences under CP ('expanded size (2) must match existing size (0)')."""
    lengths = [1, 1, 2, 1, 3]
    values = _flat(lengths, trailing=(4,))
    plan = build_plan(lengths, PlanOptions(layout, cp_size=8, tp_size=2))
    gathered = _simulate_all_ranks(plan, values)
    assert torch.equal(gathered.index_select(0, plan.token_rows()), values)


def test_local_rows_never_below_the_minimum():
    """Failure mode: fewer than D_window=128 local rows on some rank (short batch, large CP)."""
    for cp in (1, 2, 4, 8, 16):
        plan = build_plan([3, 9, 1], PlanOptions("contiguous", cp_size=cp, min_local_rows=128))
        assert plan.local_rows == 128 and plan.total_rows == 128 * cp
        assert plan.max_seqlen_padded == int(plan.seqlens_padded.max())
    plan = build_plan([1000, 900], PlanOptions("contiguous", cp_size=4, min_local_rows=128))
    assert plan.total_rows == 1900 and plan.local_rows == 475  # already above: no extra rows


def test_dtypes_and_one_host_transfer(monkeypatch):
    """A plan costs one device-to-host transfer; packing and unpacking indices cost none."""
    transfers = []
    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            transfers.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    lengths = torch.tensor([3, 5, 1, 9], dtype=torch.int32)
    for layout, balance in (("zigzag", None), ("contiguous", None), ("contiguous", "dense")):
        transfers.clear()
        options = PlanOptions(layout, cp_size=2, min_local_rows=8, pad_to_length_bucket=6, balance=balance)
        plan = build_plan(lengths, options)
        assert len(transfers) == 1, transfers  # also when the order is balanced (on the host)
        assert (plan.order is None) == (balance is None)
        for r in range(2):
            plan.pack(torch.arange(18), r, shift=True)
            plan.position_ids(r)
        plan.token_rows()
        assert len(transfers) == 1, transfers
    monkeypatch.undo()
    plan = build_plan(lengths, PlanOptions("contiguous", cp_size=2, min_local_rows=8, pad_to_length_bucket=6))
    assert plan.cu_seqlens.dtype == torch.int32 and plan.cu_seqlens_padded.dtype == torch.int32
    assert plan.cu_seqlens.tolist() == [0, 3, 8, 9, 18]
    assert plan.cu_seqlens_padded.tolist() == [0, 4, 10, 12, 24]  # per-sequence tp*cp, then bucket 6
    assert isinstance(plan.total_rows, int) and isinstance(plan.max_seqlen_padded, int)
    assert plan.max_seqlen_padded == 12


# ---------------------------------------------------------------------------- real all-gather
def _gloo_unpack(rank, world, lengths, layout, use_subgroup):
    import torch.distributed as dist

    values = _flat(lengths, trailing=(3,)).double()
    if use_subgroup:
        # Dynamic CP: the micro-batch uses a CP group of 2 inside a world of 4.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, cp, cp_rank = groups[rank // 2], 2, rank % 2
    else:
        group, cp, cp_rank = None, world, rank
    plan = build_plan(torch.tensor(lengths), PlanOptions(layout, cp_size=cp, min_local_rows=16))
    local = plan.pack(values, cp_rank).requires_grad_(True)
    out = plan.unpack(local * 2, group=group, cp_rank=cp_rank)
    assert torch.equal(out.values(), values * 2)
    assert torch.equal(out.offsets(), torch.tensor([0, *lengths]).cumsum(0))
    out.values().sum().backward()
    # The gradient flows through this rank's shard only: 2 on its real rows, 0 on padding.
    expected = (plan.gather_index(cp_rank) >= 0).double().mul(2).unsqueeze(-1).expand_as(local)
    assert torch.equal(local.grad, expected)
    cu = plan.cu_seqlens_padded
    everyone = [torch.empty_like(cu) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, cu)
    # Failure mode: cu_seqlens split per rank. They must be the global ones, identical everywhere.
    assert all(torch.equal(c, everyone[0]) for c in everyone)
    assert int(cu[-1]) == plan.total_rows
    return plan.local_rows


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_unpack_with_a_real_all_gather(layout):
    lengths = [37, 1, 90, 12]
    rows = run_distributed(_gloo_unpack, 4, args=(lengths, layout, False))
    assert len(set(rows)) == 1 and rows[0] >= 16


def test_unpack_with_an_explicit_dynamic_cp_group():
    run_distributed(_gloo_unpack, 4, args=([20, 3, 41], "contiguous", True))


def test_flat_values_is_values_without_the_dispatch():
    from verl_ds4.mcore.thd import flat_values

    values = torch.arange(10)
    x = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 10]))
    fast = flat_values(x)
    assert fast is x._values and torch.equal(fast, x.values()) and fast.data_ptr() == x.values().data_ptr()
    # Floating-point data goes through values(), so autograd sees the view.
    leaf = torch.arange(10.0, requires_grad=True)
    y = torch.nested.nested_tensor_from_jagged(leaf * 2, offsets=torch.tensor([0, 3, 10]))
    flat_values(y).sum().backward()
    assert torch.equal(leaf.grad, torch.full((10,), 2.0))


def test_plan_shares_no_memory_with_the_callers_lengths():
    lengths = torch.tensor([5, 3, 7])
    plan = build_plan(lengths, PlanOptions("contiguous", cp_size=2))
    before = plan.cu_seqlens_padded.clone(), plan.pack(torch.arange(15), 1)
    lengths.fill_(1)  # the caller reuses its tensor
    assert torch.equal(plan.cu_seqlens_padded, before[0]) and torch.equal(plan.pack(torch.arange(15), 1), before[1])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ranks_without_padding_rows_skip_the_masks_and_agree(layout):
    lengths = [64, 128, 61, 200]  # zigzag cp4: padding only in chunks near each sequence's end
    plan = build_plan(lengths, PlanOptions(layout, cp_size=4))
    values = torch.arange(sum(lengths)) + 100
    skipped = 0
    for r in range(4):
        tables = plan._tables(r)
        skipped += tables.pad is None
        info = plan.rank_rows(r)
        expect = torch.where(info.valid, values[info.source.clamp(0, values.numel() - 1)], -1)
        assert torch.equal(plan.pack(values, r, fill=-1), expect)
        assert torch.equal(plan.gather_index(r) >= 0, info.valid)
        keep = info.valid if info.keep_position is None else info.valid | info.keep_position
        assert torch.equal(plan.position_ids(r), torch.where(keep, info.position, 0))
    if layout == "zigzag":
        assert skipped >= 1  # the middle ranks hold no padding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout,balance", [("zigzag", None), ("contiguous", None), ("contiguous", "dense")])
def test_cuda_plan_matches_cpu_and_syncs_only_once(layout, balance):
    """On CUDA: the same rows as on the CPU; after the plan's one transfer, packing, positions,
    labels and unpacking never synchronise the stream (the per-rank copies go through pinned memory).
    With a balanced order, the order is computed on the host and reaches the device the same way."""
    lengths = torch.tensor([300, 5, 129, 64, 1, 77])
    values = torch.arange(int(lengths.sum())) * 3 + 1
    options = PlanOptions(layout, cp_size=4, min_local_rows=128, balance=balance)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cpu_plan = plan_from_offsets(offsets, options)
    gpu_offsets = offsets.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu_plan = plan_from_offsets(gpu_offsets, options)  # the one device-to-host transfer
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]  # the lengths' copy to the host, nothing else
    if balance is not None:
        assert torch.equal(gpu_plan.order.cpu(), cpu_plan.order) and gpu_plan.order.is_cuda
    gpu_values = values.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = [(gpu_plan.pack(gpu_values, r), gpu_plan.pack(gpu_values, r, shift=True), gpu_plan.position_ids(r))
                  for r in range(4)]  # fmt: skip
        rows = gpu_plan.token_rows()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for r, (ids, labels, positions) in enumerate(packed):
        assert torch.equal(ids.cpu(), cpu_plan.pack(values, r))
        assert torch.equal(labels.cpu(), cpu_plan.pack(values, r, shift=True))
        assert torch.equal(positions.cpu(), cpu_plan.position_ids(r))
    assert torch.equal(rows.cpu(), cpu_plan.token_rows())
