"""The straggler ratios of every engine step, reported in verl's metrics (:mod:`verl_ds4.layout.straggler`).

While the engine runs ``forward_backward_batch`` a :func:`step_scope` is open (for the passes
:func:`reported` names: every forward pass and the RL updates, not verl's SFT steps); ``forward_step`` hands
each micro-batch's plan to :func:`record` (once per micro-batch, also with virtual pipeline stages,
which run every micro-batch once per model chunk). At the end, :func:`add_metrics` puts into the
step's ``metrics`` (verl's trainer prefixes the actor update's with ``actor/``):

=====================================  ===============================================================
``perf/cp_straggler_ratio``            sum over micro-batches of the most loaded CP rank's cost over the
                                       sum of the mean rank cost: the step's CP time over balanced time
``perf/cp_straggler_ratio_max``        the worst micro-batch's max / mean (verl reduces ``max`` keys by max)
``perf/cp_straggler_ratio_batch_order`` the first with every micro-batch in batch order (without
                                       ``cp_balance``; equal to it when balance is off or zigzag)
``perf/dp_straggler_ratio``            the most loaded DP rank's total sequence cost over the mean, from
                                       verl's ``global_token_num`` (every DP rank's lengths, rank order)
=====================================  ===============================================================

Costs come from the balancer's cost model (:func:`straggler_cost_model`) and the plan's host copies of
the lengths: no device synchronisation, a few NumPy operations per micro-batch.
"""

from __future__ import annotations

import contextlib
import contextvars

from verl_ds4.layout.cost import TokenCostModel, get_cost_model
from verl_ds4.layout.straggler import StepStraggler, dp_rank_costs, ratio

__all__ = ["add_metrics", "global_token_num", "record", "report", "reported", "step_scope", "straggler_cost_model"]

_STEP: contextvars.ContextVar[tuple[StepStraggler, set] | None] = contextvars.ContextVar(
    "verl_ds4_step_straggler", default=None
)


def straggler_cost_model(balance, hf_config, is_ds4_family: bool) -> TokenCostModel:
    """The cost model the ratios use: the engine's ``cp_balance`` model when set (``PlanOptions.balance``:
    a name or a model), else the DS4 model for a DS4 / V4.1 model (from the model's own shape where
    ``cp_balance=ds4`` would use it: ``cp_balance_cost_model``) and dense causal attention otherwise."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if balance is None and not is_ds4_family:
        balance = "dense"
    elif balance is None and getattr(text, "num_hidden_layers", None) is None:
        balance = "ds4"  # no model config, or one without its layers (a bare model type): DS4-Flash's shape
    elif balance is None:
        from verl_ds4.engine.config import cp_balance_cost_model  # imports verl: only here

        balance = cp_balance_cost_model("ds4", hf_config)
    return get_cost_model(balance)


def _is_ds4_family(hf_config) -> bool:
    from verl_ds4.mcore import resolver

    return resolver.is_ds4_hf_config(hf_config) or resolver.is_ds41_hf_config(hf_config)


@contextlib.contextmanager
def step_scope(balance, hf_config=None):
    """Collect the micro-batches of one ``forward_backward_batch``; yields the :class:`StepStraggler`.
    ``balance``: the resolved layout's ``balance`` (or any cost model); ``hf_config``: the engine's model."""
    if balance is None:
        balance = straggler_cost_model(None, hf_config, _is_ds4_family(hf_config))
    step = StepStraggler(get_cost_model(balance))
    token = _STEP.set((step, set()))
    try:
        yield step
    finally:
        _STEP.reset(token)


def record(micro_batch, plans) -> None:
    """Add a micro-batch's plan (the first of its plan scope) to the open step, once per micro-batch."""
    state = _STEP.get()
    if state is None or not plans:
        return
    step, seen = state
    key = id(micro_batch)
    if key in seen:  # the same micro-batch on another virtual pipeline stage
        return
    seen.add(key)
    step.add(plans[0])


def global_token_num(data):
    """verl's ``global_token_num`` of a step's batch (every DP rank's lengths, rank order) as a list of ints, or
    ``None`` (absent, or not a flat list of lengths). ``tu.get`` unwraps both ``NonTensorData`` (verl's
    ``train_mini_batch``) and the ``NonTensorStack`` a plain list assigned with ``assign_non_tensor`` becomes."""
    from verl.utils import tensordict_utils as tu

    value = tu.get(data, key="global_token_num", default=None)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def reported(data, forward_only: bool) -> bool:
    """Whether a step's metrics carry the ratios: every forward pass, and the training steps of verl's
    ``TrainingWorker.train_mini_batch`` (the PPO / GRPO actor and critic updates), which mark each mini-batch
    ``disable_auto_offload=True`` and reduce per-rank metric lists. verl 0.9.1's SFT trainer calls
    ``train_batch`` directly and hands every metric to its trackers as it comes (here a per-DP-rank list,
    which TensorBoard and MLflow refuse): its steps carry none."""
    from verl.utils import tensordict_utils as tu

    return forward_only or bool(tu.get_non_tensor_data(data, key="disable_auto_offload", default=False))


def add_metrics(output, step: StepStraggler, global_lengths, local_count: int, dp_size: int) -> None:
    """Put the step's ratios into ``output["metrics"]`` (only where verl returns metrics: the last stage).

    The DP ratio needs ``global_lengths`` to hold ``dp_size`` shares of ``local_count`` sequences (verl's
    ``global_token_num`` for the actor update and the log-prob passes); anything else reports none."""
    metrics = output.get("metrics") if isinstance(output, dict) else None
    if metrics is None:
        return
    metrics.update(step.metrics())
    if global_lengths is not None and dp_size >= 1 and len(global_lengths) == dp_size * local_count:
        metrics["perf/dp_straggler_ratio"] = [ratio(dp_rank_costs(list(global_lengths), dp_size, step.cost_model))]


def report(output, step: StepStraggler, data, forward_only: bool, dp_size: int) -> None:
    """The engine's call after ``forward_backward_batch``: :func:`add_metrics` for the passes :func:`reported` names."""
    if reported(data, forward_only):
        add_metrics(output, step, global_token_num(data), len(data), dp_size)
