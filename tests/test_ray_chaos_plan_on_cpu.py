"""The Ray chaos run's fault schedules (:mod:`verl_ds4.testing.ray_chaos`): drawn from a seed, always ones the
launcher survives by the supervisor's own rules, and refused when it would not (the controls)."""

from __future__ import annotations

import pytest

from verl_ds4.testing.ray_chaos import KINDS, Fault, expect, plan
from verl_ds4.testing.slurm_chaos import PlanError


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    kinds = list(KINDS) * 2
    one = plan(44, steps=16, save_freq=2, max_restarts=6, kinds=kinds)
    assert one == plan(44, steps=16, save_freq=2, max_restarts=6, kinds=kinds)
    assert sorted(f.kind for f in one) == sorted(kinds)
    assert any(plan(seed, steps=16, save_freq=2, max_restarts=6, kinds=kinds) != one for seed in range(5))


def test_every_drawn_schedule_is_survivable_and_spread_over_the_run():
    for seed in range(30):
        faults = plan(seed, steps=16, save_freq=2, max_restarts=6, kinds=list(KINDS) * 2)
        starts = expect(faults, steps=16, save_freq=2, max_restarts=6)
        assert [f.step for f in faults] == sorted({f.step for f in faults}), faults  # one fault a step, in order
        for fault, start in zip(faults, starts):
            assert start is None or start < fault.step  # a save cut short is not resumed from
            assert fault.kind != "kill_in_save" or fault.step % 2 == 0


def test_retrain_draws_only_moments_after_which_a_printed_step_is_trained_again():
    steps = {plan(seed, steps=4, save_freq=2, max_restarts=1, kinds=("kill_node",), retrain=True)[0].step
             for seed in range(40)}
    assert steps == {2, 4}
    # the control: without it, step 3 (nothing trained twice: the step-2 checkpoint is resumed) is drawn too
    assert 3 in {plan(seed, steps=4, save_freq=2, max_restarts=1, kinds=("kill_node",))[0].step for seed in range(40)}


@pytest.mark.parametrize("faults, why", [
    ([Fault("kill_node", 1)], "starts from step 0"),  # before the attempt's first step: not restarted
    ([Fault("kill_in_save", 3)], "starts from step 0"),  # no save at step 3
    ([Fault("kill_rank", 5, 0), Fault("kill_node", 5)], "starts from step 4"),  # resumed from 4: step 5 is its first
    ([Fault("kill_node", 3), Fault("kill_rank", 4, 1), Fault("kill_node", 4)], "same way"),  # step 4 twice
    ([Fault("kill_node", 2), Fault("kill_node", 3)], "no restart is left"),  # budget 1
    ([Fault("meteor", 2)], "unknown fault kind"),
    ([Fault("kill_in_save", 2)], "no checkpoint to restart from"),  # the first save cut short: none is intact
])
def test_a_schedule_the_launcher_would_not_survive_is_refused(faults, why):
    budget = 1 if why == "no restart is left" else 5
    with pytest.raises(PlanError, match=why):
        expect(faults, steps=8, save_freq=2, max_restarts=budget)


def test_expect_names_where_each_next_attempt_starts():
    faults = [Fault("kill_in_save", 4), Fault("kill_node", 5), Fault("kill_rank", 8, 1)]
    # the step-4 save cut short: from 2; attempt 2 saves step 4 again before the node is lost: from 4; then from 6
    assert expect(faults, steps=8, save_freq=2, max_restarts=3) == [2, 4, 6]
