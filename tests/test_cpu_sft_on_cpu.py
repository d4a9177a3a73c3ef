"""The CPU main job, small: verl's own SFT trainer (torchrun, engine=megatron) on 2 CPU processes.

Real parts only: verl 0.9.1's ``verl.trainer.sft_trainer``, megatron-core 0.16.1's ``GPTModel``,
DDP, distributed optimizer and dist-checkpointing over gloo, verl-ds4's engine, THD packing and
the full tiny DS4 (mHC, DS4 attention, DS4 MoE with a hash layer) started from the assets' DS4
checkpoint folder, DS4 chat encoding of the data.

* CP parity: the tiny DS4 at CP=2 (contiguous THD, DP=1) and at CP=1 (DP=2) see the same global
  batches and give the same first losses to fp32 tolerance. Parameters are fp32 through
  ``CPUMcoreEngineConfig`` (verl's own Megatron engine config accepts only bf16/fp16).
* Kill and resume (issue 39): a CP=2 run is SIGKILLed inside its step-4 save; the start-up check falls
  back to step 2, and the resumed run continues with exactly the losses of an uninterrupted run. Each
  other fault (a shard cut short, a folder missing, a tracker naming a missing step, a write failing for
  lack of space, a save stopped before its manifest, a lying manifest) is injected into a copy of the
  uninterrupted run's checkpoints and checked by the start-up check (no trainer run).
* Async saves (issue 44): the same run with ``checkpoint.async_save=True`` trains on while its saves are written;
  SIGKILLed while the step-4 save is in flight (its shard writes held), the start-up check falls back to step 2
  (the step-4 folder has no manifest, the tracker is on 2), and a resumed run with async saves gives the
  uninterrupted run's losses and finalises its last save before it exits.
* Value head: verl's ``TrainingWorker(model_type="value_model")`` (the PPO critic) on the CPU engine
  gives the same per-token values at CP=2 as at CP=1 (a batch padded up to the DS4's
  128 rows per CP rank).
"""

from __future__ import annotations

import shutil
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
def reference_run(assets, tmp_path_factory):
    """Uninterrupted CP=2 run, 4 steps, a full checkpoint at steps 2 and 4 (each ends with its manifest)."""
    work = tmp_path_factory.mktemp("reference")
    start = time.monotonic()
    losses = _run(sft_command(assets, ckpt_dir=work / "ckpt", steps=4, cp=2, save_freq=2), work / "log.txt")
    print(f"\nreference run: {losses} in {time.monotonic() - start:.1f} s")
    assert sorted(losses) == [1, 2, 3, 4], losses
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    return {"losses": losses, "ckpt": work / "ckpt"}


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run["losses"]


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


def _step_files(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))


@pytest.mark.extended  # CI: the Slurm chaos run's kill inside a save
def test_sigkill_of_the_ranks_inside_a_save_then_resume_matches_uninterrupted_run(assets, reference_run, tmp_path):
    """Issue 39, the real fault: the same 4-step run (checkpoints at steps 2 and 4) is SIGKILLed inside its
    step-4 save: the test polls the filesystem until ``global_step_4`` holds files, freezes every rank
    (SIGSTOP) and checks that the step's manifest is not there yet (so the point is inside the save, exactly),
    then SIGKILLs torchrun and the ranks. The tracker is still on step 2 (it only moves after the manifest);
    the launcher's start-up check renames the unfinished ``global_step_4`` aside and resumes from step 2; the
    resumed run's losses equal the uninterrupted run's bit for bit (repr-exact floats from verl's console)."""
    import psutil

    from verl_ds4 import ckpt_manifest as cm
    from verl_ds4.recipes.ckpt_resume import choose_resume

    reference = reference_run["losses"]
    ckpt = tmp_path / "ckpt"
    tracker = ckpt / cm.TRACKER_NAME
    step4 = ckpt / "global_step_4"
    log = tmp_path / "killed.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(sft_command(assets, ckpt_dir=ckpt, steps=4, cp=2, save_freq=2), env=cpu_env(),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not _step_files(step4):
                assert proc.poll() is None, f"run ended before its step-4 save:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "no step-4 save in time"
                time.sleep(0.01)
            ranks = psutil.Process(proc.pid).children(recursive=True)
            for rank in ranks:
                rank.suspend()  # SIGSTOP: frozen where they are
            manifest_then = (step4 / cm.MANIFEST_NAME).exists()
            tracker_then = tracker.read_text()
            files_then = sorted(p.relative_to(step4).as_posix() for p in step4.rglob("*") if p.is_file())
        finally:
            kill_run(proc)  # SIGKILL torchrun and every rank, stopped inside the save
    assert len(ranks) >= 2, ranks
    assert not manifest_then, "the ranks were stopped after the step-4 manifest, not inside the save"
    assert tracker_then == "2" and tracker.read_text() == "2", "the tracker moved before the step was complete"
    print(f"\nkilled inside the step-4 save with {len(files_then)} file(s) written: {files_then[:6]}")
    killed = parse_losses(log.read_text())
    assert sorted(killed)[:2] == [1, 2] and killed == {s: reference[s] for s in killed}, (killed, reference)

    checked = choose_resume(ckpt, "auto")  # what the launcher runs before torchrun
    text = "\n".join(checked.messages)
    print(f"start-up check: step {checked.step} in {checked.seconds * 1e3:.1f} ms\n{text}")
    assert checked.step == 2 and f"{step4} is damaged or unfinished" in text, text
    assert not step4.exists() and [p.name.startswith("damaged_global_step_4_") for p in ckpt.iterdir()].count(True) == 1
    assert cm.verify_step(ckpt, 2, full=True) == [] and checked.seconds < 1.0
    # The killed run's step-2 weights are the uninterrupted run's, byte for byte: the fault cases below fall back
    # to the reference's own step 2, the same state this run resumes from. (The optimizer's and extra's shards
    # differ in bytes: Megatron's metadata holds the run's paths.)
    assert _weights_of(ckpt / "global_step_2") == _weights_of(reference_run["ckpt"] / "global_step_2")

    start = time.monotonic()
    resumed = _run(
        sft_command(assets, ckpt_dir=ckpt, steps=4, cp=2, resume_mode="auto",
                    extra=["checkpoint.save_contents=[]", "checkpoint.load_contents=[model,optimizer,extra]"]),
        tmp_path / "resumed.txt",
    )
    print(f"resumed run: {resumed} in {time.monotonic() - start:.1f} s; uninterrupted: {reference}")
    assert sorted(resumed) == [3, 4], f"resume should continue at step 3, got {resumed}"
    assert resumed == {3: reference[3], 4: reference[4]}, (resumed, reference)  # bit for bit
    assert len(set(reference.values())) == 4  # negative control: the compared losses are not one constant
    assert any(p.name.startswith("damaged_global_step_4_") for p in ckpt.iterdir())  # nothing deleted


def test_async_save_killed_in_flight_falls_back_to_the_previous_step_and_resumes_exactly(
        assets, reference_run, tmp_path):
    """Issue 44, item 2: with ``checkpoint.async_save=True`` the manifest and the tracker follow a save only once
    every rank's write is finalised. A 5-step run (async saves at steps 2 and 4, its step-4 shard writes held for
    10 minutes by :mod:`verl_ds4.testing.slow_async_writer`) trains step 5 while the step-4 save is in flight and
    then waits for it (the step-5 save first finalises the previous one); the test SIGKILLs every process there.
    Step 2 was finalised (manifest, ``.metadata``, tracker on 2), step 4 has its dataloader state and no manifest:
    the start-up check renames it aside and resumes from step 2. A run resumed from there with async saves gives
    the uninterrupted (synchronous) run's losses for steps 3 and 4 bit for bit and finalises its step-4 save
    before it exits (tracker on 4, manifest, intact). Negative control: a manifest written into the killed step 4
    before its finalisation (the order before issue 44: verl-ds4 wrote it when the save returned) makes the
    start-up check accept the unfinished step."""
    import psutil

    from verl_ds4 import ckpt_manifest as cm
    from verl_ds4.recipes.ckpt_resume import choose_resume

    reference = reference_run["losses"]
    ckpt = tmp_path / "ckpt"
    tracker = ckpt / cm.TRACKER_NAME
    step2, step4 = ckpt / "global_step_2", ckpt / "global_step_4"
    env = cpu_env()
    env["VERL_USE_EXTERNAL_MODULES"] += ",verl_ds4.testing.slow_async_writer"
    env["VERL_DS4_TEST_SLOW_SAVE"] = "global_step_4/:600"
    log = tmp_path / "killed.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(sft_command(assets, ckpt_dir=ckpt, steps=5, cp=2, save_freq=2,
                                            extra=["+checkpoint.async_save=True"]),
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while 5 not in parse_losses(log.read_text()):
                assert proc.poll() is None, f"run ended before step 5:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "no step 5 in time"
                time.sleep(0.05)
            time.sleep(1.0)  # the step-5 save begins: it waits for the step-4 save (held)
            ranks = psutil.Process(proc.pid).children(recursive=True)
            for rank in ranks:
                rank.suspend()
            in_flight = {"tracker": tracker.read_text(), "manifest_4": (step4 / cm.MANIFEST_NAME).exists(),
                         "data_4": (step4 / "data_0.pt").is_file(), "manifest_2": (step2 / cm.MANIFEST_NAME).exists()}
        finally:
            kill_run(proc)
    text = log.read_text()
    print(f"\nkilled with the step-4 async save in flight: {in_flight}")
    assert "[verl-ds4] async save of step 2 finalised on every rank" in text, text[-4000:]
    assert "[verl-ds4] save of step 4 returned to training after" in text and \
        "async save of step 4 finalised" not in text, text[-4000:]
    assert in_flight == {"tracker": "2", "manifest_4": False, "data_4": True, "manifest_2": True}, in_flight
    assert all((step2 / part / "dist_ckpt" / ".metadata").is_file() for part in ("model", "optimizer", "extra"))
    assert not (step4 / "model" / "dist_ckpt" / ".metadata").exists()  # Megatron never finalised step 4
    killed = parse_losses(text)
    assert killed[3] == reference[3] and killed[4] == reference[4], (killed, reference)  # async: the same training

    control = tmp_path / "control"  # negative control: the manifest written before the save was finalised
    shutil.copytree(ckpt, control)
    cm.write_manifest(control / "global_step_4", global_step=4)
    assert choose_resume(control, "auto", apply=False).step == 4  # the unfinished step would be loaded

    checked = choose_resume(ckpt, "auto")  # what the launcher runs before torchrun
    messages = "\n".join(checked.messages)
    print(f"start-up check: step {checked.step} in {checked.seconds * 1e3:.1f} ms\n{messages}")
    assert checked.step == 2 and f"{step4} is damaged or unfinished" in messages, messages
    assert not step4.exists() and cm.verify_step(ckpt, 2, full=True) == []

    start = time.monotonic()
    resumed_log = tmp_path / "resumed.txt"
    resumed = _run(sft_command(assets, ckpt_dir=ckpt, steps=4, cp=2, save_freq=2, resume_mode="auto",
                               extra=["+checkpoint.async_save=True"]), resumed_log)
    print(f"resumed run (async saves): {resumed} in {time.monotonic() - start:.1f} s; uninterrupted: {reference}")
    assert resumed == {3: reference[3], 4: reference[4]}, (resumed, reference)  # bit for bit
    assert "[verl-ds4] async save of step 4 finalised on every rank" in resumed_log.read_text()
    assert tracker.read_text() == "4" and cm.verify_step(ckpt, 4, full=True) == []
    assert (step4 / "model" / "dist_ckpt" / ".metadata").is_file()
    assert not (ckpt.parent / cm.TRACKER_NAME).exists()  # verl's own tracker write (two folders up) went nowhere


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


def _weights_of(folder: Path) -> dict:
    """{shard: (size, CRC-32 of the whole file)} of a checkpoint's model shards."""
    from verl_ds4 import ckpt_manifest as cm

    shards = sorted((folder / "model" / "dist_ckpt").glob("*.distcp"))
    assert shards, folder
    return {p.name: (p.stat().st_size, cm.full_crc32(p)) for p in shards}


def test_each_fault_in_a_real_checkpoint_resumes_from_the_newest_intact_step(reference_run, tmp_path):
    """Issue 39's faults, each injected into a copy of the real run's checkpoints (steps 2 and 4, the newest
    damaged, :mod:`verl_ds4.testing.ckpt_faults`), then the launcher's start-up check: a fault in step 4 falls
    back to step 2, loudly (the damaged file named), with the damaged folder renamed aside (nothing deleted),
    and leaves exactly the state the real-SIGKILL test above resumes from bit for bit (step 2 intact, the
    tracker on 2, no newer step); a tracker naming a missing step is set back to step 4, which leaves the
    uninterrupted run's folder as it was. No trainer runs here: the one e2e resume per outcome is the test above
    (step 2) and the uninterrupted folder itself (step 4). Negative controls: the copy without a fault resumes
    from step 4, and verl alone (its ``find_latest_ckpt_path``) would start from scratch on the tracker fault."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    from verl_ds4 import ckpt_manifest as cm
    from verl_ds4.recipes.ckpt_resume import choose_resume
    from verl_ds4.testing.ckpt_faults import FAULTS, inject

    source = reference_run["ckpt"]
    control = tmp_path / "none"
    shutil.copytree(source, control)
    assert choose_resume(control, "auto").step == 4 and (control / cm.TRACKER_NAME).read_text() == "4"
    rows = []
    for fault, (_, outcome) in FAULTS.items():
        ckpt = tmp_path / fault
        shutil.copytree(source, ckpt)
        damaged = inject(fault, ckpt)
        if fault == "tracker_names_missing_step":
            assert find_latest_ckpt_path(str(ckpt)) is None  # verl alone: a silent start from scratch
        checked = choose_resume(ckpt, "auto")
        text = "\n".join(checked.messages)
        rows.append(f"  {fault:32s} -> step {checked.step} in {checked.seconds * 1e3:.1f} ms")
        assert checked.seconds < 1.0, (fault, checked.seconds)
        if fault == "manifest_lies":  # sizes right, bytes wrong: the cheap check passes, the full one does not
            assert checked.step == 4 and text == "", text
            assert cm.verify_step(ckpt, 4) == [] and cm.verify_step(ckpt, 4, full=True) != []
            continue
        # The file named: the damaged one, or for a save that never reached its manifest, the missing manifest.
        unfinished = fault in ("write_fails_for_lack_of_space", "stopped_before_manifest")
        named = ckpt / "global_step_4" / cm.MANIFEST_NAME if unfinished else damaged
        assert str(named) in text, (fault, text)
        if outcome == "previous":
            assert checked.step == 2 and f"{ckpt / 'global_step_4'} is damaged or unfinished" in text, (fault, text)
            assert sorted(cm.step_folders(ckpt)) == [2] and (ckpt / cm.TRACKER_NAME).read_text() == "2"
            assert cm.verify_step(ckpt, 2, full=True) == []
            assert _weights_of(ckpt / "global_step_2") == _weights_of(source / "global_step_2")
            assert [p.name.startswith("damaged_global_step_4_") for p in ckpt.iterdir()].count(True) == 1
        else:
            assert checked.step == 4 and sorted(cm.step_folders(ckpt)) == [2, 4], (fault, text)
            assert (ckpt / cm.TRACKER_NAME).read_text() == (source / cm.TRACKER_NAME).read_text() == "4"
            assert find_latest_ckpt_path(str(ckpt)) == str(ckpt / "global_step_4")
        assert choose_resume(ckpt, "auto").messages == []  # the start after: quiet
    print("\n" + "\n".join(rows))
