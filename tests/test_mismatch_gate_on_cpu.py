"""The rollout/actor mismatch gate (verl_ds4/rollout/mismatch_gate.py): its figures, its stop, its knob, its trainer mode.

The end-to-end checks (every step of a real PPO run within 1e-5; a run whose weight sync is skipped for one
step stopped by the gate) are in tests/test_cpu_ppo_on_cpu.py. Real parts here: verl's
``compute_offpolicy_metrics`` (the k3 figure), verl's trainer registry and sync trainer, the recipe file,
the launcher's console.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from verl_ds4.rollout import mismatch_gate as gate

REPO = Path(__file__).resolve().parents[1]


def _batch():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=gen) * 3
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return old, mask


def test_figures_are_the_max_abs_log_prob_difference_and_verls_k3_on_the_response_tokens():
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    old, mask = _batch()
    rollout = old.clone()
    rollout[0, 2] += 3e-3
    rollout[2, 5] -= 1e-3
    rollout[1, 5] += 10.0  # padding: outside the mask, not counted
    figures = gate.mismatch_metrics(old, rollout, mask)
    assert figures[gate.MAX_DIFF_METRIC] == pytest.approx(3e-3, rel=1e-4)
    expected_k3 = compute_offpolicy_metrics(old.double(), rollout.double(), mask.double())["k3_kl"]
    assert figures[gate.K3_METRIC] == pytest.approx(expected_k3, rel=1e-9) and figures[gate.K3_METRIC] > 0
    # negative control: the same padding difference counts once the mask includes it
    assert gate.mismatch_metrics(old, rollout, torch.ones_like(mask))[gate.MAX_DIFF_METRIC] == pytest.approx(10.0)
    same = gate.mismatch_metrics(old, old.clone(), mask)
    assert same == {gate.MAX_DIFF_METRIC: 0.0, gate.K3_METRIC: 0.0}
    # with the threshold: how many response tokens are above it, of how many (the padding one not counted)
    counted = gate.mismatch_metrics(old, rollout, mask, threshold=2e-3)
    assert (counted[gate.ABOVE_METRIC], counted[gate.TOKENS_METRIC]) == (1, int(mask.sum()))
    assert gate.mismatch_metrics(old, rollout, mask, threshold=5e-4)[gate.ABOVE_METRIC] == 2


def test_bad_inputs_fail_clearly():
    old, mask = _batch()
    with pytest.raises(ValueError, match="must have one shape"):
        gate.mismatch_metrics(old, old[:, :5], mask)
    with pytest.raises(ValueError, match="selects no token"):
        gate.mismatch_metrics(old, old, torch.zeros_like(mask))


def test_the_gate_stops_above_the_threshold_naming_step_figure_and_knob():
    ok = {gate.MAX_DIFF_METRIC: 8e-6, gate.K3_METRIC: 1e-12}
    gate.check_mismatch(ok, step=3, threshold=1e-5)  # passes
    gate.check_mismatch({gate.MAX_DIFF_METRIC: 5.0, gate.K3_METRIC: 1.0}, step=3, threshold=None)  # report only
    with pytest.raises(gate.MismatchGateError) as err:
        gate.check_mismatch({gate.MAX_DIFF_METRIC: 0.25, gate.K3_METRIC: 0.01}, step=2, threshold=1e-5)
    message = str(err.value)
    for part in ("step 2:", "2.500e-01", "1.000e-05", gate.KNOB, gate.MAX_DIFF_METRIC, "weight sync"):
        assert part in message, (part, message)
    assert "response tokens above it" not in message  # no count without the figures
    with pytest.raises(gate.MismatchGateError, match=r"; 1 of 1024 response tokens above it\).*top-k choice"):
        gate.check_mismatch({gate.MAX_DIFF_METRIC: 2.9e-4, gate.K3_METRIC: 0.0, gate.ABOVE_METRIC: 1,
                             gate.TOKENS_METRIC: 1024}, step=24, threshold=1e-5)
    with pytest.raises(gate.MismatchGateError, match="nan"):
        gate.check_mismatch({gate.MAX_DIFF_METRIC: float("nan")}, step=1, threshold=1e-5)


def test_a_few_tokens_are_tolerated_only_when_asked_and_only_up_to_the_tolerated_difference():
    near_tie = {gate.MAX_DIFF_METRIC: 7.4e-5, gate.K3_METRIC: 2.9e-12, gate.ABOVE_METRIC: 1, gate.TOKENS_METRIC: 948}
    gate.check_mismatch(near_tie, step=32, threshold=1e-5, max_tokens_above=2)  # tolerated
    # negative controls: the default (0), more tokens than allowed, one token moved by more than 1e-3, no count
    with pytest.raises(gate.MismatchGateError, match=r"max_tokens_above \(now 0\)"):
        gate.check_mismatch(near_tie, step=32, threshold=1e-5)
    with pytest.raises(gate.MismatchGateError, match="3 of 948"):
        gate.check_mismatch({**near_tie, gate.ABOVE_METRIC: 3}, step=32, threshold=1e-5, max_tokens_above=2)
    with pytest.raises(gate.MismatchGateError, match="1 of 948"):
        gate.check_mismatch({**near_tie, gate.MAX_DIFF_METRIC: 0.12}, step=32, threshold=1e-5, max_tokens_above=2)
    with pytest.raises(gate.MismatchGateError):
        gate.check_mismatch({gate.MAX_DIFF_METRIC: 7.4e-5}, step=32, threshold=1e-5, max_tokens_above=2)
    with pytest.raises(gate.MismatchGateError, match="nan"):
        gate.check_mismatch({**near_tie, gate.MAX_DIFF_METRIC: float("nan")}, step=1, threshold=1e-5, max_tokens_above=2)


def test_the_knob_comes_from_the_recipe_and_is_checked():
    recipe = OmegaConf.load(REPO / "recipes" / "recipe" / "ds4_proxy_ppo_cpu.yaml")
    assert recipe.trainer.v1.trainer_mode == gate.TRAINER_MODE
    assert gate.gate_threshold(recipe) == 1e-5  # the default: fp32 rollout and fp32 engines (configs/cpu/laptop.yaml)

    def config(**settings):
        return OmegaConf.create({"trainer": {"v1": {gate.TRAINER_MODE: settings}}})

    assert gate.gate_threshold(config(max_log_prob_diff=None)) is None
    assert gate.gate_threshold(config(max_log_prob_diff="2e-4")) == 2e-4
    with pytest.raises(ValueError, match="needs trainer.v1.ds4_gated_sync.max_log_prob_diff"):
        gate.gate_threshold(config())
    for bad in (0, -1e-5, "abc", float("inf")):
        with pytest.raises(ValueError, match="must be a positive float or null"):
            gate.gate_threshold(config(max_log_prob_diff=bad))
    assert gate.gate_tolerance(recipe) == (0, 1e-3)
    assert gate.gate_tolerance(config(max_log_prob_diff=1e-5, max_tokens_above=2)) == (2, 1e-3)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="max_tokens_above must be an integer >= 0"):
            gate.gate_tolerance(config(max_log_prob_diff=1e-5, max_tokens_above=bad))
    for bad in (0, "abc", 1e-6):
        with pytest.raises(ValueError, match="tolerated_max_diff must be a positive float >="):
            gate.gate_tolerance(config(max_log_prob_diff=1e-5, tolerated_max_diff=bad))


def test_the_trainer_mode_is_verls_sync_trainer_and_needs_rollout_log_probs():
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cls = get_trainer_cls(gate.TRAINER_MODE)
    assert cls is gate.GatedPPOTrainerSync and issubclass(cls, PPOTrainerSync)
    assert gate.register() is cls  # idempotent
    assert cls._compute_old_log_prob is not PPOTrainerSync._compute_old_log_prob
    config = OmegaConf.create({
        "trainer": {"v1": {gate.TRAINER_MODE: {"max_log_prob_diff": 1e-5}}},
        "actor_rollout_ref": {"rollout": {"calculate_log_probs": False}},
    })  # fmt: skip
    with pytest.raises(ValueError, match="calculate_log_probs=True"):
        cls(config)
    # a custom sampler gets none of verl's group-filtering settings: filtering with it is refused
    config = OmegaConf.create({
        "trainer": {"v1": {gate.TRAINER_MODE: {"max_log_prob_diff": 1e-5},
                           "sampler": {"custom_sampler": {"path": "pkg://x", "name": "OrderedReplayBuffer"}}}},
        "algorithm": {"filter_groups": {"enable": True}},
        "actor_rollout_ref": {"rollout": {"calculate_log_probs": True}},
    })  # fmt: skip
    with pytest.raises(ValueError, match="groups would not be filtered"):
        cls(config)


def test_the_console_shows_the_figures_and_the_gate_stop():
    from verl_ds4.cpu.console_ppo import PPOConsole, summary_table

    console = PPOConsole("w", 2)
    [line] = console.on_line(
        "(TaskRunnerV1 pid=1) step:1 - critic/vf_loss:0.1 - training/rollout_log_probs_diff_max:4.7e-07 - "
        "rollout_corr/k3_kl:1.2e-13 - timing_s/step:30"
    )
    assert "lp_diff_max 4.7e-07 k3 1.2e-13" in line
    assert "lp_diff_max" in summary_table({1: {gate.MAX_DIFF_METRIC: 4.7e-7, gate.K3_METRIC: 1e-13}}).splitlines()[0]
    try:
        gate.check_mismatch({gate.MAX_DIFF_METRIC: 0.3, gate.K3_METRIC: 0.02}, step=2, threshold=1e-5)
    except gate.MismatchGateError as err:
        message = f"(TaskRunnerV1 pid=1) ray.exceptions.RayTaskError: {type(err).__name__}: {err}"
    [stop] = console.on_line(message)
    assert stop.startswith("[verl-ds4] GATE STOP") and "step 2:" in stop and gate.KNOB in stop
    assert console.on_line(message) == []  # once
    # the per-step report line is not a stop
    assert PPOConsole("w", 2).on_line(f"{gate.GATE_MARK}: step 1: {gate.MAX_DIFF_METRIC}=4.7e-07") == []


def test_the_gated_trainer_has_verls_sync_behaviour_not_the_async_one():
    """verl's trainer base treats every trainer_mode but "sync" as async (async replay buffer, one-prompt
    dataloader fetches, TransferQueue checkpoints); the gated trainer reports "sync" to it."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    trainer = object.__new__(gate.GatedPPOTrainerSync)
    trainer.trainer_mode = gate.TRAINER_MODE  # what verl's __init__ assigns from trainer.v1.trainer_mode
    assert trainer.trainer_mode == "sync"
    with pytest.raises(ValueError, match="ds4_gated_sync"):
        trainer.trainer_mode = "separate_async"
    # verl's own choice with that attribute (trainer_base._build_replay_buffer): the sync buffer
    assert (ReplayBuffer if trainer.trainer_mode == "sync" else ReplayBufferAsync) is ReplayBuffer
    # negative control: without the property verl would have picked the async one for this mode
    assert (ReplayBuffer if gate.TRAINER_MODE == "sync" else ReplayBufferAsync) is ReplayBufferAsync


def test_the_ordered_replay_buffer_lists_a_batch_in_prompt_submission_order():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from verl_ds4.rollout.ordered_replay_buffer import OrderedReplayBuffer, submission_order

    prompts = ["c3f0-aa", "01b2-zz", "9e9e-mm"]  # uuids, submitted in this order
    finished = [f"{prompts[2]}_1", f"{prompts[0]}_0", f"{prompts[1]}_10", f"{prompts[2]}_0", f"{prompts[1]}_2"]
    snapshot = {key: {"status": "success", "n": i} for i, key in enumerate(finished)}  # finishing order
    ordered = submission_order(snapshot, prompts)
    assert list(ordered) == [f"{prompts[0]}_0", f"{prompts[1]}_2", f"{prompts[1]}_10", f"{prompts[2]}_0", f"{prompts[2]}_1"]
    assert ordered == snapshot  # the same tags, only the order changes
    # negative control: verl's buffer keeps the snapshot's (finishing) order, which is not that order
    assert list(snapshot) != list(ordered)
    # it is verl's sync buffer otherwise, and refuses the async trainers
    buffer = OrderedReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                                 max_off_policy_strategy="drop", sampler_kwargs={})
    assert isinstance(buffer, ReplayBuffer)
    with pytest.raises(ValueError, match="asynchronous"):
        OrderedReplayBuffer(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=None,
                            max_off_policy_strategy="drop", sampler_kwargs={})


def test_the_ordered_replay_buffer_polls_transfer_queue_at_its_own_interval():
    """verl's buffer looks for finished responses every 2 s (a 0.3 s rollout cost a step 2 s); ours every 0.05 s."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from verl_ds4.rollout.ordered_replay_buffer import DEFAULT_POLL_INTERVAL_S, OrderedReplayBuffer

    def build(cls, **sampler_kwargs):
        return cls(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                   max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create(sampler_kwargs))

    assert build(OrderedReplayBuffer).poll_interval == DEFAULT_POLL_INTERVAL_S == 0.05
    assert build(OrderedReplayBuffer, poll_interval_s=0.5).poll_interval == 0.5  # the user's setting is kept
    assert build(ReplayBuffer).poll_interval == 2.0  # negative control: verl's own default
    for bad in (0, -1, "fast", True, 600):
        with pytest.raises(ValueError, match="poll_interval_s=.*expected seconds in"):
            build(OrderedReplayBuffer, poll_interval_s=bad)
    with pytest.raises(ValueError, match=r"unknown trainer.v1.sampler.sampler_kwargs \['poll_intervall_s'\]"):
        build(OrderedReplayBuffer, poll_intervall_s=0.1)  # a typo is not ignored
    recipe = OmegaConf.load(Path(__file__).resolve().parents[1] / "recipes" / "recipe" / "ds4_proxy_ppo_cpu.yaml")
    assert recipe.trainer.v1.sampler.sampler_kwargs.poll_interval_s == DEFAULT_POLL_INTERVAL_S


def test_the_cpu_recipes_use_the_ordered_replay_buffer():
    from verl.utils.import_utils import load_extern_type

    from verl_ds4.rollout.ordered_replay_buffer import OrderedReplayBuffer

    recipe = OmegaConf.load(Path(__file__).resolve().parents[1] / "recipes" / "recipe" / "ds4_proxy_ppo_cpu.yaml")
    custom = recipe.trainer.v1.sampler.custom_sampler
    assert load_extern_type(custom.path, custom.name) is OrderedReplayBuffer
