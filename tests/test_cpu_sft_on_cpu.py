"""The CPU main job, small: verl's own SFT trainer (torchrun, engine=megatron) on 2 CPU processes.

Real parts only: verl 0.9.1's ``verl.trainer.sft_trainer``, megatron-core 0.16.1's ``GPTModel``,
DDP, distributed optimizer and dist-checkpointing over gloo, verl-ds4's engine, THD packing and
the full tiny DS4 (mHC, DS4 attention, DS4 MoE with a hash layer) started from the assets' DS4
checkpoint folder, DS4 chat encoding of the data.

* CP parity: the tiny DS4 at CP=2 (contiguous THD, DP=1) and at CP=1 (DP=2) see the same global
  batches and give the same first losses to fp32 tolerance. Parameters are fp32 through
  ``CPUMcoreEngineConfig`` (verl's own Megatron engine config accepts only bf16/fp16).
* Kill and resume: a CP=2 run is SIGKILLed after its step-2 checkpoint; re-running resumes from it
  and continues with exactly the losses of an uninterrupted run.
* Value head: verl's ``TrainingWorker(model_type="value_model")`` (the PPO critic) on the CPU engine
  gives the same per-token values at CP=2 as at CP=1 (a batch padded up to the DS4's
  128 rows per CP rank).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
from verl_ds4.cpu.sft_run import cpu_env, kill_run, parse_losses, sft_command

RUN_TIMEOUT_S = 300


def _run(cmd: list[str], log: Path) -> dict[int, float]:
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    text = log.read_text()
    assert proc.returncode == 0, f"SFT run failed (exit {proc.returncode}); last output:\n{text[-4000:]}"
    return parse_losses(text)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_cpu_sft_assets(tmp_path_factory.mktemp("assets"), model="ds4", n_train=64)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """Uninterrupted CP=2 run, 4 steps, nothing but the dataloader state saved."""
    work = tmp_path_factory.mktemp("reference")
    cmd = sft_command(assets, ckpt_dir=work / "ckpt", steps=4, cp=2, extra=["checkpoint.save_contents=[]"])
    losses = _run(cmd, work / "log.txt")
    assert sorted(losses) == [1, 2, 3, 4], losses
    return losses


def test_cp1_and_cp2_give_the_same_first_losses(assets, reference, tmp_path):
    losses_cp1 = _run(
        sft_command(assets, ckpt_dir=tmp_path / "ckpt", steps=2, cp=1, extra=["checkpoint.save_contents=[]"]),
        tmp_path / "log.txt",
    )
    assert sorted(losses_cp1) == [1, 2]
    for step in (1, 2):
        # fp32: the CP=2 attention and loss sum the same terms in a different order (rel ~1e-7 seen).
        assert losses_cp1[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, losses_cp1, reference)
    # The step-2 loss is after one optimizer step: both runs learned the same thing.
    assert reference[2] < reference[1] and losses_cp1[2] < losses_cp1[1]


def test_kill_after_checkpoint_then_resume_matches_uninterrupted_run(assets, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    cmd = sft_command(assets, ckpt_dir=ckpt, steps=6, cp=2, save_freq=2)
    log = tmp_path / "killed.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not (tracker.exists() and tracker.read_text().strip() == "2"):
                assert proc.poll() is None, f"run ended before its step-2 checkpoint:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "no step-2 checkpoint in time"
                time.sleep(0.2)
        finally:
            kill_run(proc)  # SIGKILL torchrun and its workers, mid-training
    killed = parse_losses(log.read_text())
    assert killed[1] == reference[1] and killed[2] == reference[2], (killed, reference)
    assert tracker.read_text().strip() == "2", "the interrupted run must not have recorded a later checkpoint"
    assert (ckpt / "global_step_2").is_dir()

    resumed = _run(
        sft_command(
            assets,
            ckpt_dir=ckpt,
            steps=4,
            cp=2,
            resume_mode="auto",
            extra=["checkpoint.save_contents=[]", "checkpoint.load_contents=[model,optimizer,extra]"],
        ),
        tmp_path / "resumed.txt",
    )
    assert sorted(resumed) == [3, 4], f"resume should continue at step 3, got {resumed}"
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-6), (step, resumed, reference)


def test_value_head_cp2_matches_cp1(assets, tmp_path):
    """The critic path: verl's TrainingWorker(model_type=value_model) on the CPU engine, the tiny DS4."""
    import json
    import sys

    from verl_ds4.cpu.sft_run import free_port

    results = {}
    for cp in (1, 2):
        out = tmp_path / f"values_cp{cp}.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            "-m", "verl_ds4.cpu.value_forward", str(Path(assets["model"]).parent), str(cp), str(out),
        ]
        log = tmp_path / f"value_cp{cp}.txt"
        with open(log, "w") as f:
            proc = subprocess.run(cmd, env=cpu_env(), stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, log.read_text()[-4000:]
        results[cp] = json.loads(out.read_text())
    one, two = results[1], results[2]
    assert one["lengths"] == two["lengths"] and len(one["values"]) == sum(one["lengths"]) == len(two["values"])
    import torch

    a, b = torch.tensor(one["values"]), torch.tensor(two["values"])
    assert a.abs().sum() > 0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # fp32 model: fp32 tolerance


@pytest.mark.slow
def test_damaged_latest_checkpoint_resumes_from_the_newest_intact_one(assets, reference, tmp_path):
    """Issue 39 end to end: every real save ends with a manifest (tracker after it); a shard of the newest
    checkpoint cut short is found by the start-up check in well under a second, which falls back to the
    previous step; the resumed run continues with exactly the losses of an uninterrupted run."""
    from verl_ds4 import ckpt_manifest as cm
    from verl_ds4.recipes.ckpt_resume import choose_resume

    ckpt = tmp_path / "ckpt"
    first = _run(sft_command(assets, ckpt_dir=ckpt, steps=4, cp=2, save_freq=2), tmp_path / "first.txt")
    assert sorted(first) == [1, 2, 3, 4]
    assert cm.manifest_since(ckpt) == 2 and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    for step in (2, 4):
        assert cm.verify_step(ckpt, step, full=True) == [], step
        assert "data_0.pt" in (ckpt / f"global_step_{step}" / cm.MANIFEST_NAME).read_text()  # written after verl's
    assert "written in" in (tmp_path / "first.txt").read_text()
    assert choose_resume(ckpt, "auto", apply=False).step == 4  # control: intact, the newest is used

    shard = next((ckpt / "global_step_4" / "model" / "dist_ckpt").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    checked = choose_resume(ckpt, "auto")
    assert checked.step == 2 and str(shard) in "\n".join(checked.messages), checked.messages
    assert checked.seconds < 1.0, checked.seconds

    resumed = _run(
        sft_command(assets, ckpt_dir=ckpt, steps=4, cp=2, resume_mode="auto",
                    extra=["checkpoint.save_contents=[]", "checkpoint.load_contents=[model,optimizer,extra]"]),
        tmp_path / "resumed.txt",
    )
    assert sorted(resumed) == [3, 4], f"resume should continue at step 3, got {resumed}"
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-6), (step, resumed, reference)
    assert (ckpt / "global_step_2").is_dir()  # nothing intact deleted
