"""Holes in the peak check found in review (issue 38 item 7), each with its repro and a negative control.

(a) micro-batches in flight: verl packs whole sequences into budget x CP, so sequences longer than half of it make
    one micro-batch each (the count matches verl's ``rearrange_micro_batches``; the old bound
    ``ceil(sequences x S / (budget x CP))`` is lower and let a recipe through that peaks over the limit);
(b) ``use_dynamic_bsz=false``: every pass keeps its row, at ``micro_batch_size_per_gpu x S / CP`` rows per GPU;
(c) every pass of a colocated role runs beside the other roles' resident states (not only the update);
(vpp) interleaved 1F1B keeps Megatron's warm-up chunks in flight, and verl rounds the count to a multiple of PP.
"""

from __future__ import annotations

import pytest

from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.memory.stages import Mesh, OptimizerSettings, peak_stage, training_memory
from verl_ds4.memory.micro_batches import in_flight, micro_batches, packed_micro_batches, static_rows
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe


def _validate(overrides: list[str]):
    return validate_recipe(compose_recipe("grpo", overrides), "ppo", dry_run=True)


def _old_bound(sequences: int, dp: int, seq: int, tokens: int, cp: int) -> int:
    """The bound the check used before: sequences x longest / (budget x CP)."""
    per_rank = -(-sequences // dp)
    return max(1, -(-(per_rank * seq) // (tokens * cp)))


def _verl_count(lengths: list[int], capacity: int) -> int:
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lengths)])
    return len(rearrange_micro_batches(batch, capacity)[0])


# ---------------------------------------------------------------- (a) micro-batches in flight
@pytest.mark.parametrize("per_rank, seq, capacity", [(6, 5120, 8192), (64, 3072, 16384), (4, 9000, 16384), (7, 4000, 8192)])
def test_micro_batch_count_is_what_verl_makes(per_rank, seq, capacity):
    ours = micro_batches(per_rank * 4, 4, seq, tokens_per_gpu=capacity // 2, cp=2)
    assert ours == packed_micro_batches([seq] * per_rank, capacity) == _verl_count([seq] * per_rank, capacity)
    if 2 * seq > capacity:  # longer than half the budget x CP: one micro-batch per sequence
        assert ours == per_rank
        assert _old_bound(per_rank * 4, 4, seq, capacity // 2, 2) < ours  # negative control: the old bound is short


def test_long_sequences_in_flight_are_refused_and_a_smaller_mini_batch_is_accepted():
    """Default mesh (PP8/CP2, linear core), selective recompute, 5,120-token sequences at 4,096 tokens per GPU: a
    mini-batch of 3 x 8 sequences is 6 per DP rank, one micro-batch each (the old bound said 4: 125.7 GiB, accepted)."""
    common = ["ds4.recompute_granularity=selective", "ds4.recompute_modules=[moe_act,mhc,mla_up_proj,layernorm]",
              "ds4.recompute_method=null", "ds4.recompute_num_layers=null", "data.max_response_length=4096",
              "ds4.max_token_len_per_gpu=4096"]
    with pytest.raises(RecipeValidationError, match=r"actor memory: .*4096 tokens per GPU\) update pass, stage 0 .*peak 142\.1 GiB"):
        _validate(common + ["actor_rollout_ref.actor.ppo_mini_batch_size=3"])
    report = _validate(common + ["actor_rollout_ref.actor.ppo_mini_batch_size=2"])  # 4 per rank: 4 in flight
    actor = report.memory.roles[0]
    assert report.max_seq_len == 5120 and actor.micro_batches == 4
    peak = peak_stage(actor.stages).peak_gib
    assert peak == pytest.approx(125.7, abs=0.05) and peak <= report.memory.limit_gib
    # the refused one's count, and what the old bound made of it
    assert micro_batches(24, 4, 5120, tokens_per_gpu=4096, cp=2) == 6 and _old_bound(24, 4, 5120, 4096, 2) == 4


# ---------------------------------------------------------------- (b) use_dynamic_bsz=false
def test_fixed_micro_batches_keep_every_pass_at_their_rows():
    """16 sequences of 3,072 tokens per micro-batch over CP2 hold 24,576 rows per GPU in the update; the log-prob
    forward keeps its own row (its dynamic budget). Before, the update was modelled at the log-prob budget (16,384)
    and the forward row disappeared: 123.2 GiB, accepted."""
    fixed = ["actor_rollout_ref.actor.use_dynamic_bsz=false"]
    with pytest.raises(RecipeValidationError, match=r"actor memory: .*24576 tokens per GPU\) update pass.*peak 128\.9 GiB.*"
                                                     r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=8"):
        _validate(fixed + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])
    report = _validate(fixed + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    actor = next(r for r in report.memory.roles if r.role == "actor")
    role = next(r for r in report.roles if r.role == "actor")
    assert static_rows(8, 3072, 2) == actor.tokens_per_gpu == 12288 and actor.infer_tokens == 16384
    assert set(actor.passes) == {"update", "forward"} and actor.micro_batches == 8  # 64 per rank / 8
    assert [b.tokens_per_gpu for b in role.budgets] == [16384]  # negative control: the budget list holds only the forward's


def test_fixed_forward_micro_batches_and_a_missing_size():
    report = _validate(["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"])
    actor = next(r for r in report.memory.roles if r.role == "actor")
    assert actor.tokens_per_gpu == 8192 and actor.infer_tokens == 4 * 3072 // 2
    with pytest.raises(RecipeValidationError, match=r"ppo_micro_batch_size_per_gpu: is None with .*use_dynamic_bsz=false"):
        _validate(["actor_rollout_ref.actor.use_dynamic_bsz=false"])


# ---------------------------------------------------------------- (c) colocated passes
def test_every_pass_runs_beside_the_other_roles_resident_states():
    """Offload off (rollout in FP8 at 0.25 of the GPU so that generation fits, 64 sequences at once so that their
    KV cache fits that share) with verl's non-fused logits: the
    reference's forward, 36.6 GiB, beside the actor's 90.6 GiB of states is 127.2 GiB over 125.8. Before, only update
    passes counted them (accepted). The recipe's fused logits kernel brings both forwards under (its own check)."""
    rollout = ["ds4.rollout.quantization=fp8", "ds4.rollout.gpu_memory_utilization=0.25", "actor_rollout_ref.rollout.max_num_seqs=64"]
    offload_off = ["ds4.offload.param=false", "ds4.offload.optimizer=false"]
    with pytest.raises(RecipeValidationError) as info:
        _validate(rollout + offload_off + ["actor_rollout_ref.model.use_fused_kernels=false"])
    text = str(info.value)
    assert "ref forward: its peak 36.6 GiB plus 90.6 GiB the other roles keep on the GPU = 127.2 GiB" in text
    assert "actor forward: its peak 115.5 GiB plus 11.6 GiB" in text and "actor update:" not in text  # 111.2 + 11.6 fits
    report = _validate(rollout)  # the recipe's offload: accepted, every pass in the phases
    assert report.errors == []
    assert {name for name, _ in report.memory.phases} >= {"actor update", "actor forward", "ref forward"}
    fused = dict(_validate(rollout + offload_off).memory.phases)  # the recipe's fused kernel: the [T, V] logits never held
    assert fused["ref forward"] == pytest.approx(25.9 + 90.6, abs=0.1) and fused["actor forward"] < 125.8


# ---------------------------------------------------------------- virtual pipeline stages
def test_interleaved_pipeline_keeps_the_warm_up_chunks_in_flight():
    assert in_flight(8, 0) == 8 and in_flight(8, 7) == 1 and in_flight(8, 0, micro_batches=3) == 3
    assert in_flight(8, 0, vpp=2) == (7 * 2 + 1 * 8 + 1) / 2 == 11.5  # Megatron's interleaved warm-up + 1, 1/vpp each
    assert in_flight(8, 7, vpp=2) == 9 / 2 and in_flight(8, 0, micro_batches=3, vpp=2) == 3
    assert in_flight(8, 0, vpp=2, group=4) == (7 * 2 + 1 * 4 + 1) / 2  # microbatch_group_size_per_vp_stage=4
    assert micro_batches(256, 4, 3072, tokens_per_gpu=8192, cp=2, group=8) == 16  # 13 rounded to a multiple of PP
    from tests.test_memory_on_cpu import sizes

    flash = sizes("flash")
    plain, inter = (training_memory(flash, Mesh(64, 8, 8, 2, vpp=v), OptimizerSettings(), tokens_per_gpu=8192, recompute=None,
                                    path="linear", max_seq_len=3072) for v in (None, 2))
    assert inter[0].activations_gib == pytest.approx(plain[0].activations_gib * (11.5 - 1) / (8 - 1))
    assert inter[0].peak_gib > plain[0].peak_gib  # negative control: without vpp in the count the two were equal
    report = _validate(["ds4.mesh.vpp=2"])
    actor = report.memory.roles[0]
    assert actor.mesh.vpp == 2 and actor.micro_batches == 16
    assert peak_stage(actor.stages).peak_gib == pytest.approx(116.7, abs=0.05)  # 111.2 without vpp
    report = _validate(["ds4.mesh.vpp=2", "+actor_rollout_ref.actor.megatron.override_transformer_config.microbatch_group_size_per_vp_stage=4"])
    actor = report.memory.roles[0]
    assert actor.mesh.vp_group == 4 and actor.micro_batches == 16  # 13 rounded to a multiple of 4
    assert peak_stage(actor.stages).peak_gib < 116.7  # fewer warm-up chunks: 9.5 stage-equivalents in place of 11.5
