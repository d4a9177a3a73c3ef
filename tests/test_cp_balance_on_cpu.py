"""Cost models and the balanced contiguous CP layout (sequence order in the packed buffer)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from verl_ds4.layout import CPLayout, PlanOptions, build_plan
from verl_ds4.layout import balance as bal
from verl_ds4.layout.cost import (
    CostTerm,
    DS4CostShape,
    TokenCostModel,
    dense_causal_cost_model,
    ds4_cost_model,
    get_cost_model,
)
from verl_ds4.mcore.distributed import run_distributed

MEGATRON_CP_LENGTHS = [5, 127, 1000, 23, 129, 900, 55, 257, 800, 95, 509, 148]


def _random_lengths(gen: torch.Generator, b: int, hi: int) -> torch.Tensor:
    return torch.randint(1, hi, (b,), generator=gen)


# ----------------------------------------------------------------------------------- cost models


@pytest.mark.parametrize(
    "model",
    [
        ds4_cost_model(),
        dense_causal_cost_model(),
        dense_causal_cost_model(linear_per_token=3.0),
        TokenCostModel(
            "all-terms",
            (
                CostTerm("const", 0.5),
                CostTerm("linear", 0.01),
                CostTerm("min", 2.0, a=7),
                CostTerm("floor", 1.5, a=3),
                CostTerm("floor_cap", 4.0, a=4, b=5),
            ),
            pad_row_cost=0.5,
        ),
    ],
    ids=lambda m: m.name,
)
def test_closed_form_prefix_cost_matches_token_by_token_sum(model):
    n_max = 3000
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), model.token_cost(torch.arange(n_max)).cumsum(0)])
    n = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 19, 20, 21, 127, 128, 129, 511, 512, 2047, 2048, 2049, 2999, 3000])
    torch.testing.assert_close(model.prefix_cost(n), cumulative[n], rtol=1e-12, atol=1e-9)
    # the balancer's host path: a NumPy array in, the same float64 values out as a NumPy array
    host = model.prefix_cost(n.numpy())
    assert isinstance(host, np.ndarray) and host.dtype == np.float64
    np.testing.assert_allclose(host, cumulative[n].numpy(), rtol=1e-12, atol=1e-9)


def test_ds4_cost_terms_follow_the_attention_math():
    m = ds4_cost_model()
    c = m.token_cost(torch.tensor([0, 127, 128, 4 * 512 - 1, 4 * 512, 64 * 1024]))
    # position-independent part is the unit, then costs only grow with position
    assert c[0] > 1.0 and bool((c.diff() >= 0).all())
    # past the window and top-k, only the indexer and HCA terms grow: slope is small but positive
    late = m.token_cost(torch.tensor([100_000, 100_128]))
    assert 0 < float(late[1] - late[0]) < 0.05 * float(late[0])
    with pytest.raises(ValueError, match="0, 4 or 128"):
        DS4CostShape(layer_ratios=(0, 8)).coefficients()
    with pytest.raises(ValueError, match="unknown cost model"):
        get_cost_model("llama")


@pytest.mark.parametrize("n,cp,expected", [(16384, 4, 1.03), (65536, 16, 1.11), (131072, 16, 1.19)])
def test_ds4_single_sequence_imbalance_matches_shared_doc_estimate(n, cp, expected):
    # docs/ds4-context-parallel.md section 2: contiguous CP max/mean per-rank compute for DS4-Flash
    ratio = bal.straggler_ratio(bal.rank_costs([n], cp_size=cp, cost_model="ds4"))
    assert round(ratio, 2) == expected
    # dense causal attention is far worse for the same layout (doc: 1.5-1.9)
    assert bal.straggler_ratio(bal.rank_costs([n], cp_size=cp, cost_model="dense")) > 1.5


# ---------------------------------------------------------------------------- per-rank cost


def _reference_rank_costs(plan, model) -> torch.Tensor:
    """Row by row from the lead's plan: token cost at each valid row's position, pad cost elsewhere."""
    out = []
    for r in range(plan.cp_size):
        pos = plan.position_ids(r)
        slot = torch.searchsorted(plan.cu_seqlens_padded[1:].long(), torch.arange(plan.local_rows) + r * plan.local_rows, right=True)
        start = plan.cu_seqlens_padded.long()[slot]
        real = (plan.cu_seqlens.long().diff())[slot]
        within = torch.arange(plan.local_rows) + r * plan.local_rows - start
        valid = within < real
        assert torch.equal(pos[valid], within[valid])
        out.append(float(model.token_cost(within[valid]).sum()) + model.pad_row_cost * int((~valid).sum()))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_rank_costs_match_row_by_row_reference_on_real_plan(model_name):
    gen = torch.Generator().manual_seed(1)
    model = get_cost_model(model_name)
    for trial in range(12):
        cp = [2, 3, 4, 8][trial % 4]
        lens = _random_lengths(gen, int(torch.randint(1, 20, (1,), generator=gen)), 1500)
        if trial % 3 == 0:
            lens[0] = 0  # empty sequences are legal in the plan
        order = torch.randperm(lens.numel(), generator=gen)
        opts = PlanOptions(
            layout="contiguous",
            cp_size=cp,
            tp_size=[1, 2][trial % 2],
            min_local_rows=[None, 128, 2000][trial % 3],
            pad_to_length_bucket=[None, 96][trial % 2],
        )
        plan = build_plan(lens, opts, order=order)
        prob = bal.BalanceProblem.from_options(lens, opts, model)
        assert prob.total_rows == plan.total_rows and prob.local_rows == plan.local_rows
        torch.testing.assert_close(prob.costs(order), _reference_rank_costs(plan, model), rtol=1e-10, atol=1e-6)


def test_batched_moves_match_list_swaps_and_moves():
    """The local search builds every candidate order at once; each must be the swap (or the move:
    remove at slot i, insert at slot j) done on a Python list."""
    gen = torch.Generator().manual_seed(2)
    for trial in range(40):
        b = int(torch.randint(2, 25, (1,), generator=gen))
        order = torch.randperm(b, generator=gen).numpy()
        i = torch.randint(0, b, (30,), generator=gen).numpy()
        j = torch.randint(0, b, (30,), generator=gen).numpy()
        keep = i != j
        i, j = i[keep], j[keep]
        swap = (torch.rand(i.size, generator=gen) < 0.5).numpy()
        got = order[bal._moved_index(b, i, j, swap)]
        for k, (a, c, sw) in enumerate(zip(i.tolist(), j.tolist(), swap.tolist())):
            ref = order.tolist()
            if sw:
                ref[a], ref[c] = ref[c], ref[a]
            else:
                ref.insert(c, ref.pop(a))
            assert got[k].tolist() == ref, (a, c, sw)


# ---------------------------------------------------------------------------------- balancer


def _is_permutation(order: torch.Tensor, b: int) -> bool:
    return order.shape == (b,) and torch.equal(torch.sort(order).values, torch.arange(b))


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_balanced_is_a_permutation_deterministic_and_never_worse_than_plain(model_name):
    gen = torch.Generator().manual_seed(3)
    improved = 0
    for trial in range(16):
        b = int(torch.randint(1, 60, (1,), generator=gen))
        cp = [2, 4, 8, 16][trial % 4]
        lens = _random_lengths(gen, b, [600, 6000, 40000][trial % 3])
        kw = dict(cp_size=cp, cost_model=model_name, min_local_rows=[None, 128][trial % 2])
        order = bal.balance_order(lens, **kw)
        assert _is_permutation(order, b)
        assert torch.equal(order, bal.balance_order(lens.clone(), **kw))  # every CP rank must agree
        plain = bal.straggler_ratio(bal.rank_costs(lens, **kw))
        balanced = bal.straggler_ratio(bal.rank_costs(lens, order, **kw))
        assert balanced <= plain * (1 + 1e-12)
        improved += balanced < plain - 1e-3
    assert improved >= 5  # the search does something, not only "not worse"


def _brute_force_best(prob: bal.BalanceProblem) -> float:
    perms = torch.tensor(list(itertools.permutations(range(prob.num_seqs))))
    return float(prob.costs(perms).max(1).values.min())


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_small_batches_are_solved_exactly(model_name):
    gen = torch.Generator().manual_seed(4)
    for trial in range(8):
        b = int(torch.randint(2, 7, (1,), generator=gen))
        lens = _random_lengths(gen, b, 5000)
        prob = bal.BalanceProblem.contiguous(lens, cp_size=[2, 3, 4][trial % 3], cost_model=model_name)
        order = bal.balance_order(None, cp_size=prob.cp_size, problem=prob)
        assert float(prob.costs(order).max()) == pytest.approx(_brute_force_best(prob), rel=1e-12)


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_heuristic_is_close_to_brute_force_optimum(model_name):
    # exhaustive search switched off: the constructive candidates + local search alone
    gen = torch.Generator().manual_seed(5)
    gaps = []
    for trial in range(6):
        lens = _random_lengths(gen, 7, [3000, 20000][trial % 2])
        prob = bal.BalanceProblem.contiguous(lens, cp_size=[2, 3, 4][trial % 3], cost_model=model_name)
        best = _brute_force_best(prob)
        plain = float(prob.costs(torch.arange(7)).max())
        got = float(prob.costs(bal.balance_order(None, cp_size=prob.cp_size, problem=prob, exhaustive_max=0)).max())
        assert best <= got <= plain * (1 + 1e-12)
        gaps.append(got / best)
    assert max(gaps) < 1.05 and sum(gaps) / len(gaps) < 1.02, gaps


def test_balancing_reaches_target_on_many_short_sequences():
    gen = torch.Generator().manual_seed(6)
    lens = torch.exp(torch.randn(512, generator=gen, dtype=torch.float64) * 0.8 + 7.0).round().long().clamp(16, 8192)
    for model_name in ("ds4", "dense"):
        prob = bal.BalanceProblem.contiguous(lens, cp_size=8, cost_model=model_name)
        order = bal.balance_order(None, cp_size=8, problem=prob)
        assert bal.straggler_ratio(prob.costs(order)) <= 1.02


def _sft_lengths(seed: int) -> torch.Tensor:
    """1024 chat samples, log-normal around 700 tokens, clipped to [32, 16K] (the benchmark's "sft")."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(1024, generator=g, dtype=torch.float64) * 0.9 + 6.55).clamp(32, 16384).round().long()


def test_dense_heavy_tailed_sft_at_cp16_reaches_target():
    """The case the rank-bins start exists for: one sequence costs 1.7 mean ranks, several 0.2-0.6."""
    prob = bal.BalanceProblem.contiguous(_sft_lengths(16), cp_size=16, cost_model="dense")
    tau = prob.total_cost / 16
    assert float(prob.seq_cost.max()) > 1.5 * tau  # a giant that must straddle a boundary
    assert bal.straggler_ratio(prob.costs(torch.arange(prob.num_seqs))) >= 1.05
    start = torch.from_numpy(bal._rank_bins_order(prob))
    assert _is_permutation(start, prob.num_seqs)
    # the giant is cut by a rank boundary, not left whole inside one rank
    giant = int(prob.seq_cost.argmax())
    slot = int((start == giant).nonzero())
    begin = int(prob.padded[start[:slot]].sum())
    assert begin // prob.local_rows != (begin + int(prob.padded[giant]) - 1) // prob.local_rows
    order = bal.balance_order(None, cp_size=16, problem=prob)
    assert bal.straggler_ratio(prob.costs(order)) <= 1.02


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_large_batches_are_deterministic_permutations_never_worse_than_plain(model_name):
    """1024 sequences (the path without local search): all CP ranks must compute the same order."""
    for seed, cp in [(1, 2), (1, 8), (2, 16), (5, 16), (7, 2)]:
        lens = _sft_lengths(seed)
        prob = bal.BalanceProblem.contiguous(lens, cp_size=cp, cost_model=model_name)
        order = bal.balance_order(None, cp_size=cp, problem=prob)
        assert _is_permutation(order, lens.numel())
        again = bal.balance_order(lens.clone(), cp_size=cp, cost_model=model_name)
        assert torch.equal(order, again)
        plain = bal.straggler_ratio(prob.costs(torch.arange(lens.numel())))
        balanced = bal.straggler_ratio(prob.costs(order))
        assert balanced <= plain * (1 + 1e-12)
        if model_name == "dense" and plain >= 1.05:
            assert balanced <= 1.02, (seed, cp, plain, balanced)


def test_degenerate_batches_plan_without_errors():
    # only empty sequences: every order costs nothing; the plain order comes back
    assert torch.equal(bal.balance_order(torch.zeros(50, dtype=torch.long), cp_size=4, cost_model="dense"), torch.arange(50))
    # 1024 equal sequences (no costly ones: the rank bins hold filler only) and 1000 tiny + 3 giants
    # (at CP 4 the giants are cut by all three boundaries: adjacent giants share a rank)
    for lens in (torch.full((1024,), 500), torch.tensor([1] * 1000 + [16000] * 3)):
        for cp in (2, 4, 16):
            prob = bal.BalanceProblem.contiguous(lens, cp_size=cp, cost_model="dense")
            assert _is_permutation(torch.from_numpy(bal._rank_bins_order(prob)), lens.numel())
            order = bal.balance_order(None, cp_size=cp, problem=prob)
            assert _is_permutation(order, lens.numel())
            assert float(prob.costs(order).max()) <= float(prob.costs(torch.arange(lens.numel())).max()) * (1 + 1e-12)


def test_adjacent_giants_fill_their_ranks_left_to_right():
    """Three sequences of 1.3 mean ranks each at CP 4 cut all three boundaries, so the middle
    ranks hold two giant pieces: cutting each giant in half would leave them at 1.3 (the heavy
    constructions and local search got 1.15); filling rank by rank reaches the target."""
    lens = torch.tensor([3000] * 3 + [10] * 600 + [40] * 200)
    prob = bal.BalanceProblem.contiguous(lens, cp_size=4, cost_model="dense")
    assert float(prob.seq_cost.max()) > 1.3 * prob.total_cost / 4
    start = bal._rank_bins_order(prob)
    assert bal.straggler_ratio(prob.costs(start)) <= 1.02
    assert bal.straggler_ratio(prob.costs(bal.balance_order(None, cp_size=4, problem=prob))) <= 1.02


def test_giant_slides_to_the_best_cut_among_its_neighbours():
    """Take a rank-bins order, put the giant's 16 neighbours in order of length and displace the
    giant: the slide finds the best order of its family (the giant at any place among the
    neighbours), checked by evaluating every such order in full."""
    prob = bal.BalanceProblem.contiguous(_sft_lengths(14), cp_size=16, cost_model="dense")
    start = bal._rank_bins_order(prob, reach=8)
    giant = int(np.argmax(prob.cost))
    slot = int(np.flatnonzero(start == giant)[0])
    begin = int(prob.rows[start[:slot]].sum())
    boundary = (begin + int(prob.rows[giant])) // prob.local_rows - 1  # cut after this rank
    near = np.concatenate([start[slot - 8 : slot], start[slot + 1 : slot + 9]])
    near = near[np.argsort(prob.rows[near], kind="stable")]
    pair = lambda o: float(prob.costs_np(o[None, :])[0][boundary : boundary + 2].max())  # noqa: E731
    for shift in (-3, 2):
        displaced = start.copy()
        displaced[slot - 8 : slot + 9] = np.concatenate([near[: 8 + shift], [giant], near[8 + shift :]])
        at = slot + shift
        slid = bal._slide_giants(prob, displaced.copy(), [boundary], [at], 8)
        window = np.concatenate([displaced[at - 8 : at], displaced[at + 1 : at + 9]])
        family = []
        for j in range(17):
            o = displaced.copy()
            o[at - 8 : at + 9] = np.concatenate([window[:j], [giant], window[j:]])
            if _cut_by(prob, o, giant, boundary):
                family.append(o)
        assert _cut_by(prob, slid, giant, boundary) and _is_permutation(torch.from_numpy(slid), prob.num_seqs)
        best = min(pair(o) for o in family)
        assert pair(slid) == pytest.approx(best, rel=1e-12)
        assert pair(slid) < pair(displaced)


def _cut_by(prob, order, giant, boundary) -> bool:
    slot = int(np.flatnonzero(order == giant)[0])
    begin = int(prob.rows[order[:slot]].sum())
    return begin < (boundary + 1) * prob.local_rows < begin + int(prob.rows[giant])


def _balance_lab():
    """``benchmarks/balance_lab.py`` (exploratory heuristics and the lower bound; not product code)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "balance_lab.py"
    spec = importlib.util.spec_from_file_location("balance_lab", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("balance_lab", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["balance_lab"])
    return module


def test_lower_bound_is_below_what_any_order_reaches():
    lab = _balance_lab()
    gen = torch.Generator().manual_seed(7)
    for trial in range(6):
        lens = _random_lengths(gen, 6, [4000, 60000][trial % 2])
        prob = bal.BalanceProblem.contiguous(lens, cp_size=[2, 4][trial % 2], cost_model=["ds4", "dense"][trial % 2])
        assert lab.straggler_lower_bound(prob) <= _brute_force_best(prob) / (prob.total_cost / prob.cp_size) + 1e-9
    # one long sequence alone: nothing can be reordered; the bound proves 1.02 unreachable
    prob = bal.BalanceProblem.contiguous([131072], cp_size=16, cost_model="dense")
    bound = lab.straggler_lower_bound(prob)
    assert 1.5 < bound <= bal.straggler_ratio(prob.costs(torch.arange(1)))


# ----------------------------------------------------------------------------- plan wiring


def test_plan_option_balance_reorders_and_keeps_padding():
    lens = torch.tensor(MEGATRON_CP_LENGTHS)
    plain = build_plan(lens, PlanOptions(layout="contiguous", cp_size=4, min_local_rows=128))
    plan = build_plan(lens, PlanOptions(layout="contiguous", cp_size=4, min_local_rows=128, balance="dense"))
    assert plan.order is not None and _is_permutation(plan.order, lens.numel())
    assert (plan.total_rows, plan.local_rows) == (plain.total_rows, plain.local_rows)
    assert torch.equal(plan.cu_seqlens.long().diff(), lens[plan.order])
    costs = bal.rank_costs(lens, plan.order, cp_size=4, cost_model="dense", min_local_rows=128)
    assert bal.straggler_ratio(costs) < bal.straggler_ratio(bal.rank_costs(lens, cp_size=4, cost_model="dense", min_local_rows=128))
    # an explicit order wins over the option (never override a user's explicit choice)
    explicit = torch.arange(lens.numel()).flip(0)
    assert torch.equal(
        build_plan(lens, PlanOptions(layout="contiguous", cp_size=4, balance="ds4"), order=explicit).order, explicit
    )


def test_plan_option_balance_rejects_bad_settings():
    with pytest.raises(ValueError, match="contiguous layout only"):
        PlanOptions(layout="zigzag", cp_size=2, balance="ds4")
    with pytest.raises(ValueError, match="cost model name"):
        PlanOptions(layout="contiguous", cp_size=2, balance="fast")
    with pytest.raises(ValueError, match="contiguous layout"):
        bal.BalanceProblem.from_options([4, 5], PlanOptions(layout=CPLayout.ZIGZAG, cp_size=2))
    with pytest.raises(ValueError, match="permutation"):
        bal.rank_costs([4, 5, 6], [0, 0, 1], cp_size=2)


def _round_trip(rank, world_size, lens, values, model_name):
    # runs on every gloo rank; tensors are checked here (results travel back as plain Python values)
    opts = PlanOptions(layout="contiguous", cp_size=world_size, min_local_rows=128, balance=model_name)
    plan = build_plan(lens, opts)
    local = plan.pack(values, rank)
    out = plan.unpack(local, cp_rank=rank)  # real all-gather over the gloo CP group
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    assert torch.equal(out.offsets(), offsets)
    assert torch.equal(out.values(), values)  # original order, bit for bit
    # labels: the next token of the same sequence, wherever the balanced order put it
    labels = plan.pack(values, rank, shift=True)
    seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos = torch.arange(int(lens.sum())) - offsets[seq]
    next_token = offsets[seq] + (pos + 1) % lens[seq]
    idx = plan.gather_index(rank)
    valid = idx >= 0
    assert torch.equal(labels[valid], values[next_token[idx[valid]]])
    assert bool((labels[~valid] == 0).all())
    plain = build_plan(lens, PlanOptions(layout="contiguous", cp_size=world_size, min_local_rows=128))
    assert (plain.total_rows, plain.local_rows) == (plan.total_rows, plan.local_rows)
    return plan.order.tolist()


@pytest.mark.parametrize("model_name", ["ds4", "dense"])
def test_balanced_plan_round_trips_exactly_over_gloo(model_name):
    cp = 4
    lens = torch.tensor(MEGATRON_CP_LENGTHS + [3000, 7])
    values = torch.randn(int(lens.sum()), 3, dtype=torch.float64)
    orders = run_distributed(_round_trip, world_size=cp, args=(lens, values, model_name))
    assert all(o == orders[0] for o in orders)  # every rank planned the same order
    assert orders[0] != list(range(lens.numel()))  # the buffer really was reordered


def test_dcp_workload_is_near_linear_for_ds4_and_quadratic_for_dense():
    from verl_ds4.layout.cost import dcp_workload

    # a 4x longer sequence on 4x the ranks: DS4 per-rank work grows ~1.3x (indexer, HCA), dense ~4.4x
    ds4 = dcp_workload(131072, 16) / dcp_workload(32768, 4)
    assert 1.0 < ds4 < 1.5
    dense = dcp_workload(131072, 16, "dense") / dcp_workload(32768, 4, "dense")
    assert dense == pytest.approx(4.0 * (31 / 16) / (7 / 4), rel=0.01)  # last slice of n^2/2
    with pytest.raises(ValueError, match="cp_size >= 1"):
        dcp_workload(10, 0)


def test_ds4_proxy_cp_parity_holds_with_balance_on(monkeypatch, tmp_path):
    """The DS4 CP parity (the full tiny DS4 of verify, gloo ranks) with the balanced order switched
    on in every plan the THD path builds: CP 2 and 4 reproduce CP 1."""
    import verl_ds4.layout as layout_pkg
    from verl_ds4.layout.plan import PlanOptions as RealPlanOptions
    from verl_ds4.verify.parity import RAGGED, compare, format_table, rows_passed, run_parity

    reference = run_parity(1, dtypes=("fp64",), layout_checks=False)
    marker = tmp_path / "balanced"

    def balanced_options(**kw):
        if str(kw.get("layout")) == "contiguous" and kw.get("cp_size", 1) > 1:
            kw["balance"] = "ds4"
            marker.write_text("used")  # ranks are forked: the file proves the patch reached them
        return RealPlanOptions(**kw)

    monkeypatch.setattr(layout_pkg, "PlanOptions", balanced_options)
    for cp in (2, 4):
        order = bal.balance_order(torch.tensor(RAGGED), cp_size=cp, cost_model="ds4", min_local_rows=128)
        assert order.tolist() != list(range(len(RAGGED)))  # the proxy batch really is reordered
        rows = compare(run_parity(cp, dtypes=("fp64",), layout_checks=False), reference)
        assert rows_passed(rows), format_table(rows, f"CP={cp} balanced")
        assert max(r.max_rel for r in rows if r.expect == "match") <= 1e-10
    assert marker.read_text() == "used"


# ------------------------------------------------------------------ CP ranks agree on the order


def _plan_on_rank(rank, world_size, lens, disagree, with_group, cp_size):
    """Plan with balance on; rank 1 optionally computes a different (reversed) order."""
    import torch.distributed as dist

    import verl_ds4.layout.plan as plan_module

    if disagree and rank == 1:
        real = plan_module.balanced_host_order
        plan_module.balanced_host_order = lambda host, options: real(host, options)[::-1].copy()
    opts = PlanOptions(layout="contiguous", cp_size=cp_size, min_local_rows=128, balance="dense")
    group = dist.group.WORLD if with_group else None
    try:
        if rank % 2:
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            plan = plan_module.plan_from_offsets(offsets, opts, cp_group=group)
        else:
            plan = build_plan(lens, opts, cp_group=group)
    except (RuntimeError, ValueError) as err:
        return [type(err).__name__, str(err)]
    return ["ok", plan.order.tolist(), plan.cu_seqlens_padded.tolist()]


def test_cp_ranks_agree_on_the_balanced_order_over_gloo():
    lens = torch.tensor(MEGATRON_CP_LENGTHS + [3000, 7])
    agreed = run_distributed(_plan_on_rank, world_size=2, args=(lens, False, True, 2))
    assert [r[0] for r in agreed] == ["ok", "ok"] and agreed[0] == agreed[1]  # identical plans
    assert agreed[0][1] != list(range(lens.numel()))  # really reordered
    # one rank computes another order: every rank raises, naming what disagrees and the fix
    split = run_distributed(_plan_on_rank, world_size=2, args=(lens, True, True, 2))
    for kind, message in split:
        assert kind == "RuntimeError" and "different balanced orders" in message and "cp_balance=null" in message
    # negative control: without cp_group nothing is checked, the ranks silently disagree
    unchecked = run_distributed(_plan_on_rank, world_size=2, args=(lens, True, False, 2))
    assert [r[0] for r in unchecked] == ["ok", "ok"] and unchecked[0][1] != unchecked[1][1]
    # a group that is not the CP group (2 ranks for cp_size=4) is refused
    wrong = run_distributed(_plan_on_rank, world_size=2, args=(lens, False, True, 4))
    assert all(kind == "ValueError" and "cp_size=4" in message for kind, message in wrong)


def test_order_digest_tells_orders_apart():
    from verl_ds4.layout.plan import order_digest

    order = np.arange(20)
    assert order_digest(order) == order_digest(order.copy().astype(np.int32))
    swapped = order.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert order_digest(swapped) != order_digest(order)
    assert order_digest(order[:19]) != order_digest(order)
    assert 0 <= order_digest(order) < 2**62


def test_plan_option_balance_takes_a_cost_model_instance():
    lens = torch.tensor(MEGATRON_CP_LENGTHS + [3000, 7])
    base = dict(layout="contiguous", cp_size=4, min_local_rows=128)
    by_name = build_plan(lens, PlanOptions(**base, balance="dense")).order
    assert torch.equal(build_plan(lens, PlanOptions(**base, balance=dense_causal_cost_model())).order, by_name)
    # a DS4 shape other than Flash's default changes the costs, and the instance is what is used
    pro = ds4_cost_model(DS4CostShape(index_topk=1024, window=4096))
    opts = PlanOptions(**base, balance=pro)
    assert opts.balance is pro and opts.balance_name == "ds4"
    order = build_plan(lens, opts).order
    assert torch.equal(order, bal.balance_order(lens, cp_size=4, cost_model=pro, min_local_rows=128))
    with pytest.raises(ValueError, match=r"one of \['dense', 'ds4'\].*TokenCostModel"):
        PlanOptions(**base, balance=3)
    with pytest.raises(ValueError, match="contiguous layout only"):
        PlanOptions(layout="zigzag", cp_size=2, balance=pro)
