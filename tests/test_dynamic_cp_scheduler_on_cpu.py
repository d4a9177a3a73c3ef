"""Dynamic CP through verl 0.9.1's real ``DynamicCPScheduler`` and our engine, on gloo, against CP=1.

Two gloo ranks run ``forward_backward_batch`` of verl-ds4's CPU LM-head engine
(``CPUMegatronEngineWithLMHead``: verl's ``MegatronEngine.forward_backward_batch`` with our hooks)
with ``dynamic_context_parallel=True`` on the full tiny DS4 (mHC, sliding / CSA / HCA attention,
DS4 MoE with a hash layer) in fp64. On the way everything is the product's or verl's / Megatron's own
code: verl's dynamic-CP block and ``DynamicCPScheduler.schedule`` (through our
``ResolvedDynamicCPScheduler``, which plans every micro-batch with the resolved layout), Megatron's
``forward_backward_no_pipelining``, our forward step and ``gptmodel_forward_model_engine``, DS4
attention on the micro-batch's ``packed_seq_params.cp_group``, verl's logits processor, ``sft_loss``
and ``postprocess_dynamic_cp_batch``. The engine object is set up as ``initialize`` would leave it
(its own ``_resolve_cp_layout``), around a model built by the CP parity harness's builder in fp64,
without a model folder or an optimizer.

The batch (one sequence longer than ``max_seqlen_per_dp_cp_rank``, the rest shorter) is split by the
scheduler into a micro-batch at CP=2 and one at CP=1 (different sequences on each rank). Log-probs,
entropy, the loss and the training step's gradients (every parameter group) must equal the same
engine at CP=1 (no dynamic CP, one process) to <= 1e-10 relative; verl's own log-probs are fp32
(Megatron's cross entropy upcasts), so the fp64 runs compute them in the logits' dtype
(:func:`_log_probs_in_the_logits_dtype`) and verl's fp32 ones are compared at 1e-6.

megatron-core 0.16.1 (the newest for Python 3.11) predates the dynamic-CP API verl 0.9.1 calls, so the
test installs two stand-ins in its worker processes only (:func:`_install_megatron_dynamic_cp_api`):
``parallel_state.get_dynamic_data_context_parallel_groups`` (0.16.1 has its predecessor
``get_hybrid_data_context_parallel_groups``, without size-1 groups) and
``megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler`` (0.16.1 has its predecessor
``BalancedCPScheduler``, with another constructor and return value). Both delegate to 0.16.1's code.

Negative controls: the CP=2 micro-batch packed with the other CP rank's rows (log-probs, loss and
gradients no longer match); a micro-batch whose ranks would hold fewer rows than the model's minimum
is refused with the numbers before any forward (the bad input). The value head keeps refusing dynamic
CP at start-up (verl 0.9.1's dynamic-CP block serves language models only).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed

# max_seqlen_per_dp_cp_rank=128 (the model's minimum rows): sequence 0 needs 2 ranks, the rest fit one;
# Megatron's scheduler puts sequence 0 on both ranks (CP=2), then sequence 2 on one rank and the other
# three on the other (CP=1). Every micro-batch is padded to 128 rows per rank.
LENGTHS = (150, 40, 90, 20, 30)
MAX_SEQLEN_PER_RANK = 128
PROMPT = 3  # loss-masked first tokens of every sequence (as an SFT prompt)
SEED = 1234


def _install_megatron_dynamic_cp_api(world_size: int):
    """Stand-ins for the Megatron-Core dynamic-CP API that verl 0.9.1 calls and 0.16.1 lacks.

    * ``parallel_state.get_dynamic_data_context_parallel_groups(group_size=k)``: the aligned group of
      ``k`` consecutive DPxCP ranks holding this rank. 0.16.1 builds those groups itself
      (``initialize_model_parallel(hybrid_context_parallel=True)``, returned by
      ``get_hybrid_data_context_parallel_groups``) for ``1 < k < DPxCP`` and returns the DPxCP group for
      ``k = DPxCP``; it builds no size-1 groups, which a micro-batch at CP=1 needs, so those are real
      gloo subgroups made here with ``torch.distributed.new_group`` (every rank creates every group).
    * ``megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler``: 0.16.1's
      ``BalancedCPScheduler`` (the same algorithm under its earlier name) behind the newer constructor
      and a ``get_groups_and_subsamples`` that returns only the per-rank sample ids.

    Called in the forked worker processes only: nothing changes in the test process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets import data_schedule
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world_size)]

    def get_dynamic_data_context_parallel_groups(check_initialized=True, group_size=None):
        if group_size == 1:
            return singles[rank]
        return mpu.get_hybrid_data_context_parallel_groups(check_initialized=check_initialized, group_size=group_size)

    class DefaultDynamicCPScheduler(BalancedCPScheduler):
        def __init__(self, max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage=None):
            if microbatch_group_size_per_vp_stage is not None:
                raise NotImplementedError("virtual pipeline stages: not in megatron-core 0.16.1's scheduler")
            total = cp_size * dp_size
            super().__init__(max_seqlen_per_dp_cp_rank, type("Ranks", (), {"size": staticmethod(lambda: total)})())

        def get_groups_and_subsamples(self, sample_id_seqlens):
            _, sample_id_groups = super().get_groups_and_subsamples(sample_id_seqlens, None)
            return sample_id_groups

    mpu.get_dynamic_data_context_parallel_groups = get_dynamic_data_context_parallel_groups
    data_schedule.DefaultDynamicCPScheduler = DefaultDynamicCPScheduler


def _batch(vocab: int, lengths):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(SEED + 2)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    mask = torch.ones(sum(lengths), dtype=torch.long)
    for start in offsets[:-1].tolist():
        mask[start : start + PROMPT] = 0
    nested = lambda values: torch.nested.nested_tensor_from_jagged(values, offsets=offsets.clone())  # noqa: E731
    data = TensorDict(
        {"input_ids": nested(ids), "loss_mask": nested(mask), "temperature": torch.ones(len(lengths))},
        batch_size=[len(lengths)],
    )
    tu.assign_non_tensor(data, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(lengths))
    return data


def _engine(model, dynamic: bool):
    """verl-ds4's CPU LM-head engine around ``model``: the state ``initialize`` would set, no optimizer.

    ``forward_only=True`` in the config only means no DDP wrapper (training runs average the
    gradients over the ranks themselves, see :func:`_train`); the layout is the engine's own
    ``_resolve_cp_layout`` of the model.
    """
    from types import SimpleNamespace

    from verl_ds4.cpu.engine import CPUMcoreEngineConfig, CPUMegatronEngineWithLMHead
    from verl_ds4.engine.megatron import install_verl_hooks

    install_verl_hooks()
    engine = object.__new__(CPUMegatronEngineWithLMHead)
    engine.engine_config = CPUMcoreEngineConfig(
        dtype="float32",  # the config admits no float64; the model is built in float64 below
        forward_only=True,
        use_remove_padding=True,
        context_parallel_size=torch.distributed.get_world_size() if dynamic else 1,
        dynamic_context_parallel=dynamic,
        max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK if dynamic else None,
    )
    engine.model_config = SimpleNamespace(
        model_type="language_model",
        hf_config=SimpleNamespace(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False),
    )
    engine.tf_config = model.config
    engine.module = [model]
    engine.enable_routing_replay = False
    engine.mini_layer_topk_idx_list = []
    engine._resolve_cp_layout(engine.module)
    return engine


def _worker(rank: int, world: int, dynamic: bool):
    import logging

    from megatron.core import parallel_state as mpu
    from verl.plugin.platform.platform_manager import set_platform

    from verl_ds4.cpu.platform import PlatformCPU
    from verl_ds4.verify.parity import _Models, _ds4_config
    from verl_ds4.models.ds4.mcore_attention import DS4HybridSelfAttention

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    set_platform(PlatformCPU())  # what VERL_PLATFORM=cpu selects in the CPU jobs (this forked rank only)
    mpu.initialize_model_parallel(context_parallel_size=world, hybrid_context_parallel=dynamic)
    try:
        if dynamic:
            _install_megatron_dynamic_cp_api(world)
        # The CPU jobs' tiny DS4 as the engine runs it: no MTP, indexer loss off (verify's harness turns both on).
        models = _Models("ds4", {**_ds4_config(None), "num_nextn_predict_layers": 0}, seed=SEED)
        models.indexer_loss_coeff = 0.0
        model = models.build(torch.float64).eval()
        engine = _engine(model, dynamic)
        attention_cp_sizes = []  # the CP group size of every DS4 attention call
        original_cp_group = DS4HybridSelfAttention._cp_group

        def recording_cp_group(self, packed_seq_params):
            group = original_cp_group(self, packed_seq_params)
            attention_cp_sizes.append(1 if group is None else torch.distributed.get_world_size(group))
            return group

        DS4HybridSelfAttention._cp_group = recording_cp_group
        data = _batch(models.vocab, LENGTHS)
        result = {"fp32_log_probs": _run(engine, data, attention_cp_sizes)}  # verl's own log-probs (fp32)
        with _log_probs_in_the_logits_dtype():
            result.update(_run(engine, data, attention_cp_sizes))
            result["train"] = _train(engine, model, data)
            if dynamic:
                with _other_ranks_rows():
                    result["other_ranks_rows"] = _run(engine, data, attention_cp_sizes)
                    result["other_ranks_rows_train"] = _train(engine, model, data)
                with _plans_without_the_row_minimum():
                    try:
                        _run(engine, data, attention_cp_sizes)
                        result["too_few_rows"] = {"error": None}
                    except Exception as err:  # noqa: BLE001 (reported to the test)
                        error = f"{type(err).__name__}: {err}"
                        result["too_few_rows"] = {"error": error, "attention_calls": len(attention_cp_sizes)}
        return result
    finally:
        mpu.destroy_model_parallel()


def _run(engine, data, attention_cp_sizes) -> dict:
    """One ``forward_backward_batch`` (forward only, verl's SFT loss); what the engine returned."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DCP_SAMPLE_IDS
    from verl.workers.utils.losses import sft_loss

    from verl_ds4.mcore.batch_plans import PLAN_KEY

    scheduled = []  # (local_cp_size, sample ids) of every micro-batch this rank ran
    plan_rows = []  # rows per rank of the plan our scheduler attached to it

    def loss_function(model_output, data, dp_group=None):
        local_cp_size = tu.get_non_tensor_data(data, "local_cp_size", None)
        scheduled.append((local_cp_size, tu.get_non_tensor_data(data, DCP_SAMPLE_IDS, None)))
        plan = tu.get_non_tensor_data(data, PLAN_KEY, None)
        plan_rows.append(None if plan is None else plan.local_rows)
        return sft_loss(None, model_output, data, dp_group)

    attention_cp_sizes.clear()
    start = time.perf_counter()
    with torch.no_grad():
        output = engine.forward_backward_batch(data, loss_function, forward_only=True)
    out = output["model_output"]  # on the engine's output rank (CP rank 0) only, as in verl
    return {
        "log_probs": out["log_probs"].values().numpy() if "log_probs" in out else None,
        "log_probs_dtype": str(out["log_probs"].dtype) if "log_probs" in out else None,
        "entropy": out["entropy"].values().numpy() if "entropy" in out else None,
        "loss": float(sum(float(x) for x in output["loss"])),  # one loss per micro-batch (group leaders)
        "losses": [float(x) for x in output["loss"]],
        "scheduled": scheduled,
        "plan_rows": plan_rows,
        "attention_cp_sizes": sorted(set(attention_cp_sizes)),
        "resolved": engine.resolved_cp_layout.describe(),
        "min_local_rows": engine.resolved_cp_layout.min_local_rows,
        "seconds": time.perf_counter() - start,
    }


def _train(engine, model, data) -> dict:
    """One training ``forward_backward_batch`` (verl's SFT loss); the loss and the DPxCP-mean gradients.

    Megatron's schedule multiplies every micro-batch's loss by the static CP size, because its DDP
    averages gradients over the DPxCP group; the gradients are therefore averaged over all ranks
    here (what DDP's all-reduce gives every rank), then grouped as in the CP parity harness.
    """
    from verl.workers.utils.losses import sft_loss

    from verl_ds4.verify.parity import _grads

    model.zero_grad(set_to_none=True)

    def loss_function(model_output, data, dp_group=None):
        return sft_loss(None, model_output, data, dp_group)

    output = engine.forward_backward_batch(data, loss_function, forward_only=False)
    world = torch.distributed.get_world_size()
    summed = _grads(model, torch.distributed.group.WORLD)
    grads = {name: None if g is None else g / world for name, g in summed.items()}
    model.zero_grad(set_to_none=True)
    return {"loss": float(sum(float(x) for x in output["loss"])), "grads": grads}


def _grad_groups(ours: dict, ref: dict) -> dict[str, float]:
    """Per parameter group (:func:`verl_ds4.verify.parity.param_group`): max |ours - ref| / max |ref|."""
    from verl_ds4.verify.parity import param_group

    diff, scale = {}, {}
    for name, g in ref.items():
        group, d = param_group(name), ours[name]
        if g is None and d is None:
            continue
        g = np.zeros_like(d) if g is None else g
        d = np.zeros_like(g) if d is None else d
        diff[group] = max(diff.get(group, 0.0), float(np.max(np.abs(d - g))))
        scale[group] = max(scale.get(group, 0.0), float(np.max(np.abs(g))))
    return {group: diff[group] / max(scale[group], 1e-300) for group in diff}


@contextlib.contextmanager
def _log_probs_in_the_logits_dtype():
    """Log-probs in the model's dtype (fp64), for a comparison at fp64.

    verl's ``vocab_parallel_log_probs_from_logits`` is Megatron's ``vocab_parallel_cross_entropy``,
    which upcasts the logits to float32: verl's log-probs (and the SFT loss from them) are fp32
    whatever the model's dtype. In this worker only, the engine's logits processor gets the same
    quantity at TP=1 in the logits' dtype (log-softmax gathered at the labels); the entropy is verl's.
    """
    from megatron.core import parallel_state as mpu
    from verl.workers.engine.megatron import transformer_impl

    assert mpu.get_tensor_model_parallel_world_size() == 1  # a full vocabulary on every rank
    original = transformer_impl.vocab_parallel_log_probs_from_logits
    transformer_impl.vocab_parallel_log_probs_from_logits = (
        lambda logits, labels: torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    )
    try:
        yield
    finally:
        transformer_impl.vocab_parallel_log_probs_from_logits = original


@contextlib.contextmanager
def _other_ranks_rows():
    """Negative control: a CP=2 micro-batch packs (and unpacks) the other CP rank's rows."""
    from verl_ds4.mcore import thd

    original = thd.cp_context

    def swapped(local_cp_size):
        size, rank, group, extra = original(local_cp_size)
        return (size, size - 1 - rank, group, extra) if local_cp_size == 2 else (size, rank, group, extra)

    thd.cp_context = swapped
    try:
        yield
    finally:
        thd.cp_context = original


@contextlib.contextmanager
def _plans_without_the_row_minimum():
    """Bad input: micro-batches planned without the model's minimum rows per CP rank."""
    import dataclasses

    from verl_ds4.mcore.resolver import ResolvedCPLayout

    original = ResolvedCPLayout.plan_options
    ResolvedCPLayout.plan_options = lambda self, local_cp_size=None: dataclasses.replace(
        original(self, local_cp_size), min_local_rows=None
    )
    try:
        yield
    finally:
        ResolvedCPLayout.plan_options = original


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _preload():
    """Import the heavy modules once in this process, so the forked ranks start at once."""
    import importlib

    for name in (
        "verl.workers.engine.megatron.transformer_impl",
        "verl.workers.utils.losses",
        "megatron.core.pipeline_parallel.hybrid_cp_schedule",
        "verl_ds4.cpu.engine",
        "verl_ds4.verify.parity",
        "verl_ds4.models.ds4.model",
    ):
        importlib.import_module(name)


@pytest.fixture(scope="module")
def reference():
    _preload()
    return run_distributed(_worker, 1, args=(False,), timeout=300)[0]


@pytest.fixture(scope="module")
def dynamic():
    _preload()
    return run_distributed(_worker, 2, args=(True,), timeout=300)


def test_the_scheduler_splits_the_batch_into_cp_sizes_2_and_1(dynamic):
    by_rank = [sorted((size, tuple(ids)) for size, ids in r["scheduled"]) for r in dynamic]
    sizes = {size for rank in by_rank for size, _ in rank}
    assert sizes == {1, 2}, by_rank
    # the CP=2 micro-batch is the same sequence on both ranks; the CP=1 ones differ and hold the rest
    assert [ids for size, ids in by_rank[0] if size == 2] == [ids for size, ids in by_rank[1] if size == 2] == [(0,)]
    singles = [ids for rank in by_rank for size, ids in rank if size == 1]
    assert len(singles) == 2 and sorted(i for ids in singles for i in ids) == list(range(1, len(LENGTHS)))
    for r in dynamic:  # DS4 attention ran on each micro-batch's dynamic group: both sizes
        assert r["attention_cp_sizes"] == [1, 2], r["attention_cp_sizes"]
        assert r["plan_rows"] == [128, 128], r["plan_rows"]  # our plans, padded to the model's minimum
        assert "cp=dynamic" in r["resolved"] and r["min_local_rows"] == 128
        assert len(r["losses"]) == 3  # verl collected one loss per micro-batch (CP=2, and CP=1 on each rank)


@pytest.mark.parametrize("quantity", ["log_probs", "entropy", "loss"])
def test_dynamic_cp_equals_cp1_at_fp64(dynamic, reference, quantity):
    assert reference["scheduled"] == [(None, None)] and reference["plan_rows"] == [None]  # CP=1, no scheduler
    ranks = dynamic if quantity == "loss" else dynamic[:1]  # per-token outputs: verl's output rank
    for r in ranks:
        rel = _rel(np.asarray(r[quantity]), np.asarray(reference[quantity]))
        assert rel <= 1e-10, (quantity, rel)


def test_dynamic_cp_training_step_equals_cp1_at_fp64(dynamic, reference):
    """The training step: verl's loss and every parameter group's gradient (DPxCP mean) equal CP=1."""
    ref = reference["train"]
    for r in dynamic:
        assert _rel(np.asarray(r["train"]["loss"]), np.asarray(ref["loss"])) <= 1e-10
    groups = _grad_groups(dynamic[0]["train"]["grads"], ref["grads"])
    assert {"embeddings", "attention", "hc", "router", "experts", "shared_experts"} <= set(groups), groups
    assert max(groups.values()) <= 1e-10, groups


def test_verls_own_fp32_log_probs_agree_too(dynamic, reference):
    """verl's log-probs (Megatron's cross entropy, fp32) through the same path: equal to fp32 rounding."""
    ours, ref = dynamic[0]["fp32_log_probs"], reference["fp32_log_probs"]
    assert ours["log_probs_dtype"] == ref["log_probs_dtype"] == "torch.float32"
    assert dynamic[0]["log_probs_dtype"] == "torch.float64"  # the fp64 runs above
    assert _rel(ours["log_probs"], ref["log_probs"]) <= 1e-6
    assert _rel(np.asarray(ours["loss"]), np.asarray(ref["loss"])) <= 1e-6


def test_rows_of_the_other_cp_rank_fail_the_comparison(dynamic, reference):
    """Negative control: the CP=2 micro-batch's rows packed for the other rank no longer match CP=1."""
    control = dynamic[0]["other_ranks_rows"]
    assert sorted({size for size, _ in control["scheduled"]}) == [1, 2]
    assert _rel(control["log_probs"], reference["log_probs"]) > 1e-3
    assert _rel(np.asarray(control["loss"]), np.asarray(reference["loss"])) > 1e-6
    train = dynamic[0]["other_ranks_rows_train"]
    assert _rel(np.asarray(train["loss"]), np.asarray(reference["train"]["loss"])) > 1e-6
    assert max(_grad_groups(train["grads"], reference["train"]["grads"]).values()) > 1e-3


def test_a_micro_batch_with_too_few_rows_per_rank_is_refused_before_the_forward(dynamic):
    """Planned without the 128-row minimum, the CP=2 micro-batch (150 tokens) gives 75 rows per rank."""
    for r in dynamic:
        refused = r["too_few_rows"]
        assert refused["error"] is not None and refused["attention_calls"] == 0, refused  # no forward ran
        assert refused["error"].startswith("CPLayoutError"), refused
        assert "split over local_cp_size=2 ranks gives 75 rows per rank, but the model needs at least 128" in refused["error"]


# ------------------------------------------------------------------ the rule and the value head, in-process


def _nested(lengths):
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(torch.arange(sum(lengths)), offsets=offsets)


def test_check_dynamic_cp_rows_refuses_with_the_numbers():
    """``check_dynamic_cp_rows``: fewer rows per rank than the model's minimum are refused, naming them."""
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore import thd
    from verl_ds4.mcore.model_forward import check_dynamic_cp_rows
    from verl_ds4.mcore.resolver import CPLayoutError, ResolvedCPLayout

    resolved = ResolvedCPLayout(layout="contiguous", min_local_rows=128, cp_size=2, tp_size=1, dynamic_cp=True)
    unpadded = PlanOptions(layout="contiguous", cp_size=2)  # no minimum rows
    short = _nested((40, 30, 20, 10))
    expected = r"4 sequences / 100 tokens split over local_cp_size=2 ranks gives 50 rows per rank, but the model needs at least 128"
    with pytest.raises(CPLayoutError, match=expected) as err:
        check_dynamic_cp_rows(thd.make_plan(short, unpadded), resolved, 2)
    assert "plan_options(local_cp_size=2) pads to 2 * 128 rows" in str(err.value)  # how to fix it
    with pytest.raises(CPLayoutError, match="gives 127 rows per rank"):  # one row short
        check_dynamic_cp_rows(thd.make_plan(_nested((200, 54)), unpadded), resolved, 2)
    # negative controls: the engine's own plan of the same batch, exactly the minimum, no minimum
    check_dynamic_cp_rows(thd.make_plan(short, resolved.plan_options(local_cp_size=2)), resolved, 2)
    check_dynamic_cp_rows(thd.make_plan(_nested((200, 56)), unpadded), resolved, 2)
    no_minimum = ResolvedCPLayout(layout="contiguous", min_local_rows=None, cp_size=2, tp_size=1, dynamic_cp=True)
    check_dynamic_cp_rows(thd.make_plan(short, unpadded), no_minimum, 2)


def test_the_cpu_value_engine_keeps_refusing_dynamic_cp_at_start_up():
    """verl 0.9.1's dynamic-CP block serves language models only; our value engines refuse it at start-up."""
    from types import SimpleNamespace

    from verl_ds4.cpu.engine import CPUMcoreEngineConfig, CPUMegatronEngineWithLMHead, CPUMegatronEngineWithValueHead
    from verl_ds4.mcore.resolver import CPLayoutError

    model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"]))
    config = CPUMcoreEngineConfig(dtype="float32", dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK)
    with pytest.raises(CPLayoutError, match="not supported for value models .* dynamic_context_parallel=False"):
        CPUMegatronEngineWithValueHead._check_startup_settings(
            object.__new__(CPUMegatronEngineWithValueHead), model_config, config
        )
    # negative control: the LM-head engine (the one the gloo test above runs) accepts the same settings
    CPUMegatronEngineWithLMHead._check_startup_settings(object.__new__(CPUMegatronEngineWithLMHead), model_config, config)
