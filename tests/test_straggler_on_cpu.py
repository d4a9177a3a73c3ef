"""Straggler ratios from lengths alone (verl_ds4/layout/straggler.py) and the engine's per-step metrics
(verl_ds4/engine/straggler.py), checked against an independent count: every row a CP rank holds, read
from the plan's own row tables (``gather_index`` / ``position_ids``), costed token by token with
``TokenCostModel.token_cost`` (not the closed-form prefix sums the ratios use).

The engine path itself (the metric in a real CPU engine step, verl's TrainingWorker under torchrun)
is checked in ``tests/test_engine_differential_on_cpu.py`` on runs that test already makes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ds4.engine import straggler as engine_straggler
from verl_ds4.layout import PlanOptions, build_plan
from verl_ds4.layout.cost import dense_causal_cost_model, ds4_cost_model
from verl_ds4.layout.straggler import (
    StepStraggler,
    batch_order_rank_costs,
    dp_rank_costs,
    plan_rank_costs,
    ratio,
    zigzag_rank_costs,
)

MODELS = {"ds4": ds4_cost_model(), "dense": dense_causal_cost_model(linear_per_token=3.0)}
# skewed on purpose: the long sequences first, so the batch order loads the first ranks
LENGTHS = [3000, 2500, 40, 700, 5, 1200, 64, 333, 9, 128, 1500, 77]


def token_by_token(plan, model) -> np.ndarray:
    """Per-rank cost from the rows each rank really holds (the plan's tables), one token at a time."""
    out = []
    for r in range(plan.cp_size):
        source, position = plan.gather_index(r), plan.position_ids(r)
        real = source >= 0
        out.append(float(model.token_cost(position[real]).sum()) + model.pad_row_cost * int((~real).sum()))
    return np.array(out)


@pytest.mark.parametrize("model", list(MODELS), ids=str)
@pytest.mark.parametrize(
    "layout,balance,cp",
    [("contiguous", None, 4), ("contiguous", "model", 4), ("contiguous", "model", 8), ("zigzag", None, 4)],
)
def test_plan_rank_costs_equal_the_rows_each_rank_holds(model, layout, balance, cp):
    cost = MODELS[model]
    options = PlanOptions(layout, cp_size=cp, min_local_rows=128 if layout == "contiguous" else None,
                          balance=cost if balance else None)
    plan = build_plan(torch.tensor(LENGTHS), options)
    expected = token_by_token(plan, cost)
    np.testing.assert_allclose(plan_rank_costs(plan, cost), expected, rtol=1e-10)
    if balance is None:  # without balance the buffer is the batch order
        np.testing.assert_allclose(batch_order_rank_costs(plan, cost), expected, rtol=1e-10)
    else:  # the counterfactual: the same micro-batch planned without balance
        plain = build_plan(torch.tensor(LENGTHS), PlanOptions(layout, cp_size=cp, min_local_rows=128))
        np.testing.assert_allclose(batch_order_rank_costs(plan, cost), token_by_token(plain, cost), rtol=1e-10)
        # negative control: the balanced buffer is cheaper at its worst rank than the batch order (DS4 costs
        # are nearly flat at these lengths: 1.003 vs 1.008 at CP 4; dense causal attention is not)
        gap = 0.002 if model == "ds4" else 0.05
        assert ratio(plan_rank_costs(plan, cost)) < ratio(token_by_token(plain, cost)) - gap


def test_a_deliberately_unbalanced_order_reports_a_higher_ratio():
    cost = MODELS["dense"]
    options = PlanOptions("contiguous", cp_size=4, min_local_rows=128)
    lengths = torch.tensor(LENGTHS)
    worst = torch.argsort(lengths, descending=True)  # every long sequence on the first ranks
    bad = build_plan(lengths, options, order=worst)
    good = build_plan(lengths, PlanOptions("contiguous", cp_size=4, min_local_rows=128, balance=cost))
    bad_ratio, good_ratio = ratio(plan_rank_costs(bad, cost)), ratio(plan_rank_costs(good, cost))
    assert bad_ratio == pytest.approx(ratio(token_by_token(bad, cost)), rel=1e-10)
    assert bad_ratio > 1.25 > 1.05 > good_ratio


def test_zigzag_balances_one_dense_sequence_and_contiguous_does_not():
    cost = dense_causal_cost_model()
    zig = zigzag_rank_costs([4096], [4096], 4, cost)
    assert ratio(zig) == pytest.approx(1.0, abs=1e-3)
    contiguous = build_plan(torch.tensor([4096]), PlanOptions("contiguous", cp_size=4))
    assert ratio(plan_rank_costs(contiguous, cost)) == pytest.approx(7 / 4, rel=1e-3)  # last quarter: 7/16 of it
    with pytest.raises(ValueError, match="multiples of 2\\*cp=8"):
        zigzag_rank_costs([4095], [4095], 4, cost)


def test_step_ratio_is_time_weighted_over_micro_batches():
    step = StepStraggler(MODELS["dense"])
    step.add_costs([4.0, 2.0], [6.0, 0.0])  # max 4, mean 3 (batch order: max 6)
    step.add_costs([1.0, 1.0])  # balanced
    metrics = step.metrics()
    assert metrics["perf/cp_straggler_ratio"] == [pytest.approx(5 / 4)]
    assert metrics["perf/cp_straggler_ratio_max"] == [pytest.approx(4 / 3)]
    assert metrics["perf/cp_straggler_ratio_batch_order"] == [pytest.approx(7 / 4)]
    assert StepStraggler(MODELS["dense"]).metrics() == {}


def test_dp_ratio_from_every_ranks_lengths():
    cost = dense_causal_cost_model()
    costs = dp_rank_costs([3, 1, 2, 2], 2, cost)  # rank 0: 6 + 1, rank 1: 3 + 3 keys
    np.testing.assert_allclose(costs, [7.0, 6.0])
    assert ratio(costs) == pytest.approx(7 / 6.5)
    with pytest.raises(ValueError, match="do not split into dp_size=3"):
        dp_rank_costs([1, 2, 3, 4], 3, cost)


def test_engine_step_scope_records_each_micro_batch_once_and_fills_verl_metrics():
    cost = MODELS["ds4"]
    plans = [build_plan(torch.tensor(LENGTHS[:6]), PlanOptions("contiguous", cp_size=4)),
             build_plan(torch.tensor(LENGTHS[6:]), PlanOptions("contiguous", cp_size=4))]
    batches = [object(), object()]
    with engine_straggler.step_scope(cost) as step:
        for batch, plan in zip(batches + batches, plans + plans):  # a second virtual pipeline stage
            engine_straggler.record(batch, (plan,))
    engine_straggler.record(batches[0], (plans[0],))  # outside a step: ignored
    assert step.num_micro_batches == 2
    output = {"metrics": {}}
    engine_straggler.add_metrics(output, step, LENGTHS, local_count=6, dp_size=2)  # 2 DP ranks x 6 sequences
    got = output["metrics"]
    per_mb = [token_by_token(p, cost) for p in plans]
    expected = sum(c.max() for c in per_mb) / sum(c.mean() for c in per_mb)
    assert got["perf/cp_straggler_ratio"] == [pytest.approx(expected)]
    assert got["perf/cp_straggler_ratio_max"] == [pytest.approx(max(ratio(c) for c in per_mb))]
    per_seq = [float(cost.token_cost(torch.arange(n)).sum()) for n in LENGTHS]
    dp = [sum(per_seq[:6]), sum(per_seq[6:])]
    assert got["perf/dp_straggler_ratio"] == [pytest.approx(max(dp) / np.mean(dp))]
    # lengths that are not every DP rank's (a count that does not match): no DP ratio, never a wrong one
    output = {"metrics": {}}
    engine_straggler.add_metrics(output, step, LENGTHS[:8], local_count=6, dp_size=2)
    assert "perf/dp_straggler_ratio" not in output["metrics"] and "perf/cp_straggler_ratio" in output["metrics"]
    empty = {}
    engine_straggler.add_metrics(empty, step, LENGTHS, local_count=6, dp_size=2)  # not the last pipeline stage
    assert empty == {}


def test_cost_model_is_the_balancers():
    assert engine_straggler.straggler_cost_model(None, None, is_ds4_family=False).name == "dense"
    assert engine_straggler.straggler_cost_model(None, None, is_ds4_family=True).name == "ds4"
    own = MODELS["dense"]
    assert engine_straggler.straggler_cost_model(own, None, is_ds4_family=True) is own
    assert engine_straggler.straggler_cost_model("dense", None, is_ds4_family=True).name == "dense"


def test_a_model_config_without_its_layers_takes_flashs_shape_and_verls_length_lists_are_read():
    """The engine's step must not fail on its metrics: a bare DS4 model type (no layer count) costs with
    DS4-Flash's shape (it raised ``TypeError`` before), and ``global_token_num`` assigned as a plain list
    (a ``NonTensorStack`` in the TensorDict, as the CPU value head's forward does) is read as lengths."""
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    bare = SimpleNamespace(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
    assert engine_straggler.straggler_cost_model(None, bare, is_ds4_family=True).name == "ds4"
    # negative control: the balancer's own shape builder needs the layers, so it cannot be used on this config
    from verl_ds4.engine.config import cp_balance_cost_model

    with pytest.raises(TypeError):
        cp_balance_cost_model("ds4", bare)
    for assign in (lambda td: tu.assign_non_tensor(td, global_token_num=[5, 7, 9]),
                   lambda td: tu.assign_non_tensor_data(td, "global_token_num", [5, 7, 9])):
        td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
        assign(td)
        assert engine_straggler.global_token_num(td) == [5, 7, 9]
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    tu.assign_non_tensor(td, global_token_num=[[1], [2], [3]])  # not a flat list of lengths: no DP ratio
    assert engine_straggler.global_token_num(td) is None
